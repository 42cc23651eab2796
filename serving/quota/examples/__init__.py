"""Example configuration files shipped with the quota package (data only)."""
