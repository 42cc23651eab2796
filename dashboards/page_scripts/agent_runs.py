"""Page script (run by Streamlit through ``app.py``): see :mod:`kvmeter.dashboards.views.agent_runs`."""

from kvmeter.dashboards import ui
from kvmeter.dashboards.views import agent_runs as view

ui.run_page(view.TITLE, view.CAPTION, view.render)
