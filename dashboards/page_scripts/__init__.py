"""Page scripts run by Streamlit (see ``app.py``)."""
