"""Page script (run by Streamlit through ``app.py``): see :mod:`kvmeter.dashboards.views.overview`."""

from kvmeter.dashboards import ui
from kvmeter.dashboards.views import overview as view

ui.run_page(view.TITLE, view.CAPTION, view.render)
