"""Page script (run by Streamlit through ``app.py``): see :mod:`kvmeter.dashboards.views.tenants`."""

from kvmeter.dashboards import ui
from kvmeter.dashboards.views import tenants as view

ui.run_page(view.TITLE, view.CAPTION, view.render)
