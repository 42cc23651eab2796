"""Package layout: the top-level folders are sub-packages of ``kvmeter``.

The repository keeps the user's own layout (``serving/``, ``collectors/``, ``exporters/``,
``ledger/``, ``dashboards/`` at the top), and this file maps each folder into the single
``kvmeter`` namespace, so code imports ``kvmeter.serving.gateway`` and nothing generic such as
``ledger`` lands in site-packages. Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ["serving", "collectors", "exporters", "ledger", "dashboards"]

package_dir = {"kvmeter": "kvmeter"}
packages = ["kvmeter"] + [f"kvmeter.{p}" for p in find_packages("kvmeter")]
for folder in TOP_LEVEL:
    package_dir[f"kvmeter.{folder}"] = folder
    packages += [f"kvmeter.{folder}"] + [f"kvmeter.{folder}.{p}" for p in find_packages(folder)]

# Non-Python files shipped inside packages (price lists, rule files, SQL migrations, default configs).
package_data = {"": ["*.yaml", "*.yml", "*.sql", "*.toml", "*.json", "*.jinja", "*.html", "*.css"]}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
