"""The models a gateway serves: each served name's engine and scheduler. One job: find a
request's model.

A single-model gateway serves its engine's model under its one scheduler. A multi-model gateway
(``engine.models``, :class:`~kvmeter.serving.config.ModelPoolSettings`) serves one engine pool per
model, each under its own fair scheduler (its own router, replica gates, health and drain): a
request goes to the model its ``model`` field names; one that names none goes to the first
(``default``), as vLLM's server serves its model to a request without a name. A name that is not
served is vLLM's 404 (:func:`~kvmeter.serving.openai_api.errors.model_not_found`) naming every
served model, the one shape the single-model path answers too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from kvmeter.serving.engines.base import Engine
from kvmeter.serving.openai_api.errors import model_not_found
from kvmeter.serving.scheduler.base import Scheduler

__all__ = ["ServedModel", "ServedModels"]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One served model: ``name`` (what requests, ``/v1/models``, usage and metrics call it), the
    ``engine`` that runs it (an :class:`~kvmeter.serving.engines.pool.EnginePool` for a pool)
    and the ``scheduler`` that dispatches to it."""

    name: str
    engine: Engine
    scheduler: Scheduler


class ServedModels:
    """The served models, in the configured order (the first is the default).

    Args:
        models: at least one, distinct names.
    Raises:
        ValueError: no model, or a name twice.
    """

    def __init__(self, models: list[ServedModel]) -> None:
        names = [m.name for m in models]
        if not models or len(set(names)) != len(names):
            raise ValueError(f"served models need distinct names, at least one; got {names!r}")
        self._by_name: Mapping[str, ServedModel] = {m.name: m for m in models}
        self.names: tuple[str, ...] = tuple(names)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def default(self) -> ServedModel:
        """The first model: what a request without a ``model`` gets."""
        return self._by_name[self.names[0]]

    def get(self, name: str | None) -> ServedModel:
        """The model ``name`` names (None or empty: :attr:`default`).

        Raises:
            OpenAIError: vLLM's 404 ``model_not_found`` naming every served model.
        """
        if not name:
            return self.default
        served = self._by_name.get(name)
        if served is None:
            raise model_not_found(name, self.names)
        return served

    def name_of(self, name: object) -> str:
        """The served name a request's ``model`` value resolves to: itself when served, else the
        default's (what a request refused before its model is checked is attributed to)."""
        return name if isinstance(name, str) and name in self._by_name else self.names[0]
