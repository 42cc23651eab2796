"""Page script (run by Streamlit through ``app.py``): see :mod:`kvmeter.dashboards.views.gpu`."""

from kvmeter.dashboards import ui
from kvmeter.dashboards.views import gpu as view

ui.run_page(view.TITLE, view.CAPTION, view.render)
