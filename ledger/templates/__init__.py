"""Jinja2 templates of the billing and reconciliation HTML reports."""
