"""Price lists: per model and token type, per-tier discounts, one rounding rule.

The file format is documented in the packaged ``prices.yaml``. Numbers are parsed straight
into :class:`~decimal.Decimal` from their YAML text (a float is never formed), so ``0.30``
means exactly 0.30.

The price function — :meth:`PriceList.cost`, the one formula kvmeter prices tokens with: the
quota's spend estimate and its reconciliation, billing's invoice lines, the usage summary's cost
column (and so the read API and the dashboards) all call it::

    tokens[type]      = the four disjoint parts of TokenCounts, by type:       (TokenCounts.parts)
                          input        = input_tokens − cached_input_tokens
                          cached_input = cached_input_tokens
                          output       = output_tokens − reasoning_tokens
                          reasoning    = reasoning_tokens
    unit_price[type]  = price_per_million[type] / 1,000,000 × (1 − tier_discount)
    cost              = Σ_type tokens[type] × unit_price[type]            (exact, scale ≤ 18)

Reasoning tokens have a price of their own: ``reasoning`` in the list, defaulting to the model's
``output`` price where the list gives none.

**The rounding point.** ``cost`` is exact and never rounded; the only rounding is
:meth:`PriceList.round`, applied once to each invoice line's subtotal (the cost of the line's
token sums), to the list's ``quantum`` with its rounding mode; a total is the sum of rounded
lines. The quota holds exact costs too (the store counts nano-units, rounded up:
:mod:`kvmeter.serving.quota.money`).

Price per million ≤ 6 decimal places and discount ≤ 6 places keep every unit price within
18 decimal places, so ``Decimal(38, 18)`` (ClickHouse and polars) holds it exactly; the products
and sums are computed in a 60-digit context that traps any inexact step.
"""

from __future__ import annotations

import decimal
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvmeter.tokens import PRICED_PARTS, TokenCounts

from .errors import PriceListError, UnpricedModel

__all__ = ["TOKEN_TYPES", "ModelPrice", "PriceList", "load_price_list", "parse_price_list"]

#: Billed token types, in invoice order: the disjoint parts of
#: :meth:`kvmeter.tokens.TokenCounts.parts` (see the module docstring).
TOKEN_TYPES = PRICED_PARTS
_MILLION = Decimal(1_000_000)
#: Exact arithmetic: every step fits 60 digits for any count below 10^40 tokens; an inexact step
#: would raise instead of rounding silently.
_EXACT = decimal.Context(prec=60, rounding=decimal.ROUND_HALF_EVEN,
                         traps=[decimal.Inexact, decimal.InvalidOperation, decimal.Overflow])
_MAX_PLACES = 6
_ROUNDING_MODES = {name for name in dir(decimal) if name.startswith("ROUND_")}


class _DecimalLoader(yaml.SafeLoader):
    """SafeLoader that reads YAML floats as exact Decimals."""


def _construct_decimal(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Decimal:
    text = loader.construct_scalar(node).replace("_", "")
    try:
        return Decimal(text)
    except decimal.InvalidOperation:
        raise PriceListError(f"not a decimal number: {text!r}") from None


_DecimalLoader.add_constructor("tag:yaml.org,2002:float", _construct_decimal)


def _decimal(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or isinstance(value, float):
        raise PriceListError(f"{where}: {value!r} is not an exact decimal")
    try:
        d = Decimal(value) if isinstance(value, (int, str, Decimal)) else None
    except decimal.InvalidOperation:
        d = None
    if d is None or not d.is_finite():
        raise PriceListError(f"{where}: {value!r} is not a decimal number")
    return d


def _places(d: Decimal) -> int:
    exponent = d.normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """List prices of one model, in currency per 1,000,000 tokens (Decimal, ≥ 0).

    ``reasoning`` defaults to ``output``.
    """

    model: str
    input: Decimal
    cached_input: Decimal
    output: Decimal
    reasoning: Decimal

    def per_million(self, token_type: str) -> Decimal:
        """Price per million tokens of ``token_type`` (one of :data:`TOKEN_TYPES`)."""
        return getattr(self, token_type)


@dataclass(frozen=True, slots=True)
class PriceList:
    """A validated price list.

    Attributes:
        version: label of this list (shown on invoices, stored in the ``prices`` table).
        currency: ISO 4217 code.
        quantum: rounding step of an invoice line (e.g. ``Decimal("0.01")``).
        rounding: Python decimal rounding mode name (e.g. ``ROUND_HALF_EVEN``).
        models: served model name (or alias) → :class:`ModelPrice`.
        tier_discounts: tier → discount fraction in [0, 1].
        source: where it was loaded from.
    """

    version: str
    currency: str
    quantum: Decimal
    rounding: str
    models: Mapping[str, ModelPrice]
    tier_discounts: Mapping[str, Decimal] = field(default_factory=dict)
    source: str = ""
    # (model, tier) → the four unit prices in TOKEN_TYPES order (the list never changes)
    _units: dict[tuple[str, str], tuple[Decimal, ...]] = field(default_factory=dict, init=False, repr=False,
                                                               compare=False)

    def price_for(self, model: str) -> ModelPrice | None:
        """The model's prices, or ``None`` if the list does not price it."""
        return self.models.get(model)

    def discount(self, tier: str) -> Decimal:
        """The tier's discount fraction (0 for a tier the list does not name)."""
        return self.tier_discounts.get(tier, Decimal(0))

    def unit_price(self, model: str, tier: str, token_type: str) -> Decimal | None:
        """Exact price of one token after the tier discount, or ``None`` for an unpriced model.

        Raises:
            KeyError: for an unknown token type.
        """
        if token_type not in TOKEN_TYPES:
            raise KeyError(f"unknown token type {token_type!r}; expected one of {TOKEN_TYPES}")
        units = self._unit_prices(model, tier)
        return None if units is None else units[TOKEN_TYPES.index(token_type)]

    def _unit_prices(self, model: str, tier: str) -> tuple[Decimal, ...] | None:
        units = self._units.get((model, tier))
        if units is None:
            price = self.models.get(model)
            if price is None:
                return None
            keep = _EXACT.subtract(1, self.discount(tier))
            units = tuple(_EXACT.multiply(_EXACT.divide(price.per_million(t), _MILLION), keep)
                          for t in TOKEN_TYPES)
            self._units[(model, tier)] = units
        return units

    def cost(self, model: str, tier: str, tokens: TokenCounts) -> Decimal:
        """The exact price of ``tokens`` of ``model`` at ``tier``: the one price function (the
        rule and its rounding point are in the module docstring).

        Args:
            model: the served model name (or an alias the list names).
            tier: the tier whose discount applies (a tier the list does not name pays list price).
            tokens: the counts to price (one request's, or the sums of an invoice line).
        Returns:
            A ``Decimal`` ≥ 0, exact (unrounded), in the list's currency.
        Raises:
            UnpricedModel: the list does not price ``model``.
        """
        units = self._unit_prices(model, tier)
        if units is None:
            raise UnpricedModel(model)
        total = Decimal(0)
        for count, unit in zip(tokens.parts(), units, strict=True):  # zero counts too: the sum keeps the units' scale
            total = _EXACT.add(total, _EXACT.multiply(unit, count))
        return total

    def cost_if_priced(self, model: str, tier: str, tokens: TokenCounts) -> Decimal | None:
        """:meth:`cost`, or ``None`` for a model the list does not price (an invoice line or a
        summary row that cannot be priced)."""
        return self.cost(model, tier, tokens) if model in self.models else None

    def round(self, amount: Decimal) -> Decimal:
        """Round one invoice line's exact subtotal by the list's rule (the only rounding of a price)."""
        return amount.quantize(self.quantum, rounding=self.rounding)

    @property
    def rounding_rule(self) -> str:
        """Human-readable rounding rule, e.g. ``ROUND_HALF_EVEN to 0.01 USD per invoice line``."""
        return f"{self.rounding} to {self.quantum} {self.currency} per invoice line"

    def to_mapping(self) -> dict[str, Any]:
        """The list in the file format (numbers as exact decimal strings): what
        :func:`parse_price_list` reads back to an equal list (the read API sends it so
        ``billing report --server`` prices with the server's list)."""
        models: dict[str, dict[str, Any]] = {}
        for alias, price in self.models.items():
            spec = models.setdefault(price.model, {t: format(price.per_million(t), "f") for t in TOKEN_TYPES})
            if alias != price.model:
                spec.setdefault("aliases", []).append(alias)
        return {"version": self.version, "currency": self.currency,
                "rounding": {"quantum": format(self.quantum, "f"), "mode": self.rounding},
                "tiers": {t: format(d, "f") for t, d in self.tier_discounts.items()}, "models": models}

    def rows(self) -> list[dict[str, Any]]:
        """(model, token_type, price_per_million) rows for the ``prices`` table."""
        out = []
        for name, price in sorted(self.models.items()):
            for t in TOKEN_TYPES:
                out.append({"model": name, "token_type": t, "price_per_million": price.per_million(t)})
        return out


def parse_price_list(data: Mapping[str, Any], source: str = "") -> PriceList:
    """Validate a parsed price list mapping (see ``prices.yaml`` for the format).

    Raises:
        PriceListError: naming the first offending key and value.
    """
    if not isinstance(data, Mapping):
        raise PriceListError(f"{source}: a price list is a mapping at top level")
    unknown = set(data) - {"version", "currency", "rounding", "tiers", "models"}
    if unknown:
        raise PriceListError(f"{source}: unknown top-level key(s) {sorted(unknown)}")
    version = str(data.get("version") or "")
    currency = data.get("currency")
    if not version:
        raise PriceListError(f"{source}: `version` is required")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        raise PriceListError(f"{source}: `currency` must be a 3-letter ISO 4217 code, got {currency!r}")
    rounding = data.get("rounding") or {}
    quantum = _decimal(rounding.get("quantum", "0.01"), f"{source}: rounding.quantum")
    if quantum <= 0:
        raise PriceListError(f"{source}: rounding.quantum must be > 0, got {quantum}")
    mode = rounding.get("mode", "ROUND_HALF_EVEN")
    if mode not in _ROUNDING_MODES:
        raise PriceListError(f"{source}: rounding.mode {mode!r} is not one of {sorted(_ROUNDING_MODES)}")
    tiers: dict[str, Decimal] = {}
    for tier, value in (data.get("tiers") or {}).items():
        d = _decimal(value, f"{source}: tiers.{tier}")
        if not Decimal(0) <= d <= Decimal(1):
            raise PriceListError(f"{source}: tiers.{tier} discount must be in [0, 1], got {d}")
        if _places(d) > _MAX_PLACES:
            raise PriceListError(f"{source}: tiers.{tier} has more than {_MAX_PLACES} decimal places")
        tiers[str(tier)] = d
    models_in = data.get("models")
    if not isinstance(models_in, Mapping) or not models_in:
        raise PriceListError(f"{source}: `models` must map model names to prices")
    models: dict[str, ModelPrice] = {}
    for name, spec in models_in.items():
        if not isinstance(spec, Mapping):
            raise PriceListError(f"{source}: models.{name} must be a mapping of token type to price")
        extra = set(spec) - set(TOKEN_TYPES) - {"aliases"}
        if extra:
            raise PriceListError(f"{source}: models.{name}: unknown key(s) {sorted(extra)}; "
                                 f"token types are {TOKEN_TYPES}")
        values: dict[str, Decimal] = {}
        for t in ("input", "cached_input", "output"):
            if t not in spec:
                raise PriceListError(f"{source}: models.{name}.{t} is required")
        for t in TOKEN_TYPES:
            if t not in spec:
                continue
            d = _decimal(spec[t], f"{source}: models.{name}.{t}")
            if d < 0:
                raise PriceListError(f"{source}: models.{name}.{t} must be >= 0, got {d}")
            if _places(d) > _MAX_PLACES:
                raise PriceListError(f"{source}: models.{name}.{t} has more than {_MAX_PLACES} decimal places")
            values[t] = d
        values.setdefault("reasoning", values["output"])
        price = ModelPrice(model=str(name), **values)
        for alias in [str(name)] + [str(a) for a in (spec.get("aliases") or [])]:
            if alias in models:
                raise PriceListError(f"{source}: model name or alias {alias!r} is priced twice")
            models[alias] = price
    return PriceList(version=version, currency=currency.upper(), quantum=quantum, rounding=mode,
                     models=models, tier_discounts=tiers, source=source)


def load_price_list(path: str | Path | None = None) -> PriceList:
    """Load and validate a price list file; ``None`` loads the packaged ``prices.yaml``.

    Raises:
        PriceListError: on a missing file, bad YAML or an invalid entry.
    """
    try:
        if path is None:
            text = resources.files("kvmeter.ledger").joinpath("prices.yaml").read_text("utf-8")
            source = "kvmeter.ledger/prices.yaml"
        else:
            text = Path(path).read_text("utf-8")
            source = str(path)
    except OSError as exc:
        raise PriceListError(f"cannot read price list {path}: {exc}") from None
    try:
        data = yaml.load(text, Loader=_DecimalLoader)  # noqa: S506 — a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PriceListError(f"{source}: not valid YAML: {exc}") from None
    return parse_price_list(data, source)
