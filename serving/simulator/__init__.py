"""The discrete-event simulator of GPU vLLM replicas (``kvmeter simulate``).

``Simulation`` replays a trace through the scheduler core and simulated replicas in virtual time
(the fast path); ``SimEngine`` puts one simulated replica behind the :class:`Engine` boundary so the
gateway can run on it with a clock. Traces load through :func:`kvmeter.traces.load_trace`; the
ServeGen tenant mapping is :mod:`.tenants`.
"""

from .costmodel import RooflineCostModel
from .engine import SimEngine
from .hardware import ACCELERATORS, AcceleratorSpec, get_accelerator
from .kvcache import PrefixCache
from .models import MODELS, ModelSpec, get_model
from .replica import SimReplica, SimRequest, StepOutcome
from .report import build_report, format_report, write_report
from .runner import RequestRecord, SimConfig, SimResult, Simulation, build_cost_model
from .tenants import ServeGenTenantMap, load_servegen_rates, servegen_arrivals

__all__ = [
    "RooflineCostModel", "SimEngine", "AcceleratorSpec", "ACCELERATORS", "get_accelerator",
    "PrefixCache", "ModelSpec", "MODELS", "get_model", "SimReplica", "SimRequest", "StepOutcome",
    "build_report", "format_report", "write_report", "RequestRecord", "SimConfig", "SimResult",
    "Simulation", "build_cost_model", "ServeGenTenantMap", "load_servegen_rates", "servegen_arrivals",
]
