r"""A stand-in of the Kubernetes scheduler's structured allocator, for tests, as strict as the real one.

No kube-scheduler runs in the tests, so claims are allocated here as the scheduler's DynamicResources
plugin allocates them: `allocate` takes the ResourceSlices an API server holds (the dicts of
kube_api_stand_in.py), the ResourceClaim to allocate, the claims already allocated, the node and the
DeviceClasses, and returns the claim's `status.allocation` as resource.k8s.io/v1 writes it, or raises
`Unschedulable` where the real allocator finds none and `AllocatorError` where it returns an error.
What it does not model it refuses with `NotModelled`, never guessing. Each behaviour copies a named
place of the real source: k8s.io/dynamic-resource-allocation (kubernetes/kubernetes
staging/src/k8s.io/dynamic-resource-allocation; written DRAL below, `structured/internal/` written
`internal/`) at the release of each server version: v0.34.9 for 1.34, v0.35.6 for 1.35, v0.36.2 for
1.36. The scheduler's plugin is kubernetes/kubernetes pkg/scheduler/framework/plugins/dynamicresources
(written `plugin/`).

| behaviour | where the real one does it |
|---|---|
| which allocator runs: "stable", "incubating" or "experimental", the first whose features cover the enabled ones; features from the scheduler's gates (AdminAccess and PrioritizedList on; the DRA gates of kube_api_stand_in.default_gates, `gates` overrides) | DRAL structured/allocator.go NewAllocator, availableAllocators; internal/types.go Features; plugin/dynamicresources.go New (structured.Features from the feature gates) |
| the state of what is allocated, from the allocated claims: results with adminAccess are not allocated; with DRAConsumableCapacity a result with a shareID is a shared device (its consumedCapacity summed per device), any other result an allocated device | plugin/allocateddevices.go foreachAllocatedDevice, addDevices; DRAL schedulerapi/types.go ConsumedCapacityCollection Insert |
| slices considered: 1.35+ the node's slices plus those without nodeName or with sharedCounters; with DRAPartitionableDevices off, slices with sharedCounters or perDeviceNodeSelection are skipped | internal/incubating/allocator_incubating.go NewAllocator, Allocate; pools_incubating.go GatherPools |
| pools: slices grouped by (driver, pool), only the highest generation kept | pools_incubating.go addSlice |
| a pool short of resourceSliceCount slices: 1.35+ its generation is looked for among all slices (a newer one elsewhere: the pool is ignored as obsolete), still short: incomplete; devices of incomplete or invalid pools are never allocated; when nothing is found and a pool was invalid: unschedulable "invalid resource pools were encountered". 1.34: incomplete pools are allocated from; reaching an invalid pool in the search is an error "pool P is invalid: R" | pools_incubating.go GatherPools, checkSlicesInPool; allocator_incubating.go allocateOne, Allocate (ErrFailedAllocationOnNode); v0.34.9 internal/incubating/allocator_incubating.go allocateOne |
| invalid pools: a device name twice ("duplicate device name N"); 1.35+ also a counter set twice ("duplicate counter set name N"), a consumesCounters naming an unknown set ("counter set N not found") or counter ("counter C not found in counter set N") | pools_incubating.go buildPool, validateDeviceNames, getAndValidateCounterSets, validateDeviceCounterConsumption; v0.34.9 pools_incubating.go poolIsInvalid |
| search order: pools by driver then pool name, slices by name (1.36; 1.34 and 1.35 walked a Go map and the informer's order, so any order: this stand-in uses 1.36's), devices in slice order; first fit, depth-first with backtracking, claim by claim, request by request; within a request only combinations (each next device after the previous one) | pools_incubating.go sortPoolsByID, sortSlicesByName; allocator_incubating.go allocateOne (startLocation) |
| ExactCount: `count` devices; All: every selectable device, refused when a pool is incomplete or invalid ("asks for all devices, but resource pool P is currently being updated" / "invalid"), none: no allocation | allocator_incubating.go validateDeviceRequest, allocateOne |
| errors of a claim: no device class name, an unknown class, adminAccess or subrequests or capacity requests with their feature off, more than 32 devices | allocator_incubating.go Allocate, validateDeviceRequest; k8s.io/api resource/v1 types.go AllocationResultsMaxSize |
| a device in use: allocated (not shared) or being allocated for another claim of this call; adminAccess skips that check but not the same claim | allocator_incubating.go allocateOne, allocateDevice, deviceInUse |
| selectors: the class's, then the request's; a CEL runtime error is an error of the whole allocation | allocator_incubating.go isSelectable, selectorsMatch |
| CEL: device.driver, device.allowMultipleAllocations, device.attributes[domain].id and device.capacity[domain].id (a name without a domain is the driver's; an unknown domain is an empty map; an unknown id an error "no such key: id"), ==, !=, <, <=, >, >=, &&, \|\|, !, compareTo(quantity("...")); && and \|\| absorb an error when the other side decides | DRAL cel/compile.go DeviceMatches, parseQualifiedName, newStringInterfaceMapWithDefault; cel-go logical operators and heterogeneous equality |
| counters (KEP-4815): a device with consumesCounters, DRAPartitionableDevices off: not allocatable; on: what its pool's counter sets (1.35+; 1.34: its own slice's sharedCounters) hold, less what allocated devices consume (1.36: shared devices count as allocated; 1.34, 1.35: only unshared ones), less what the devices being allocated consume, must stay ≥ 0 for every counter | allocator_incubating.go allocateDevice, checkAvailableCounters, deallocateCountersForDevice; internal/allocatedstate.go IsDeviceAllocated (v0.36); v0.35.6 experimental, v0.34.9 incubating checkAvailableCounters |
| a device with allowMultipleAllocations whose capacity is already in use (allocated with a consumedCapacity, or being allocated) skips the counter check (1.35+); a rolled-back allocation of such a device does not give its counters back; nor does a device refused after its counters were taken (an untolerated taint, capacity): they stay taken for the rest of that search | allocator_incubating.go allocateDevice (skipCounterCheck, the returned rollback) |
| taints: 1.35+ a NoSchedule or NoExecute taint not tolerated prevents allocation; 1.34 any taint not tolerated; tolerations as core/v1's | allocator_incubating.go taintPreventsAllocation; v0.34.9 allTaintsTolerated; DRAL resourceclaim/devicetoleration.go ToleratesTaint |
| consumable capacity (KEP-5075): every capacity of the device is consumed: the request's value, none requested: the policy's default, else the whole capacity; validRange rounds up to min + k*step (below min: min), validValues to the first value ≥ the request; a value above max, off the step or not a valid value (unless the default) makes the device unsuitable; a request naming a capacity the device lacks: unsuitable; allocated + allocating + this must not exceed the capacity's value | incubating/consumable_capacity.go CmpRequestOverCapacity, calculateConsumedCapacity, fillEmptyRequest, roundUpRange, roundUpValidValues, violatesPolicy |
| results: request (`req/sub` for a subrequest), driver, pool, device, adminAccess only when true, tolerations of the request, shareID and consumedCapacity only for a device with allowMultipleAllocations (consumedCapacity only when not empty) | allocator_incubating.go Allocate, allocateDevice |
| shareID: a new random UUID (version 4) per allocation | internal/allocatedstate.go GenerateShareID (k8s.io/apimachinery util/uuid NewUUID) |
| config: each class's configs once, FromClass, requests the requests that use the class; then the claim's configs, FromClaim, once per request (or chosen subrequest) they name, once when they name none | allocator_incubating.go Allocate ("Populate configs") |
| nodeSelector: any device from a slice with nodeName: matchFields metadata.name In [node]; all from allNodes slices: none | allocator_incubating.go createNodeSelector |
| quantities: parsed as apimachinery's (exact values, the format of the suffix), written in canonical form; roundUpRange's result is a BinarySI quantity | apimachinery/pkg/api/resource/quantity.go ParseQuantity, CanonicalizeBytes, Value; amount.go AsCanonicalBytes, AsCanonicalBase1024Bytes |
| the scheduler's reason when no allocation is found: "cannot allocate all claims" | plugin/dynamicresources.go Filter |

Not modelled (NotModelled): claim constraints (matchAttribute, distinctAttribute), slices with a
nodeSelector or perDeviceNodeSelection, devices with bindingConditions or bindsToNode, list-typed
attributes (DRAListTypeAttributes), CEL beyond the forms above (no macros, has(), in, arithmetic,
semver(), string functions; string literals without escapes), quantities finer than 1n. Not modelled
either: scoring (the first fit is taken, as the real allocator does without scoring), the time limit of
an allocation, extended resources. Where the real allocator compares a policy's default with Go's
struct equality of two Quantities, this one compares values: the same for a default the API server
accepts (unverified: that validation requires the default to satisfy its policy).
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kube_api_stand_in import SERVER_VERSIONS, KubeApiStandIn, default_gates

ALLOCATION_RESULTS_MAX_SIZE = 32  # k8s.io/api resource/v1 types.go AllocationResultsMaxSize
CANNOT_ALLOCATE = "cannot allocate all claims"  # plugin/dynamicresources.go Filter
INVALID_POOLS = "invalid resource pools were encountered"  # allocator_incubating.go Allocate


class Unschedulable(Exception):
    """No allocation on this node: the scheduler's Filter answers Unschedulable with `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AllocatorError(Exception):
    """What the real Allocate returns as an error (a broken claim, class or selector): the scheduler
    aborts the pod's scheduling attempt with it."""


class NotModelled(Exception):
    """Input this stand-in does not model; the real allocator would do something with it."""


# -- quantities (apimachinery/pkg/api/resource/quantity.go) --------------------------------------------

BINARY_SI, DECIMAL_SI, DECIMAL_EXPONENT = "BinarySI", "DecimalSI", "DecimalExponent"
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")


@dataclass(frozen=True)
class Quantity:
    """A resource.Quantity: its exact value and the format its suffix gave it."""
    value: Fraction
    format: str = DECIMAL_SI

    @classmethod
    def parse(cls, text: Any) -> Quantity:
        if isinstance(text, Quantity):
            return text
        if isinstance(text, bool) or not isinstance(text, (str, int)):
            raise AllocatorError(f"quantity {text!r}: not a string")
        match = _QUANTITY.fullmatch(str(text).strip())
        if match is None:
            raise AllocatorError(f"quantity {text!r}: quantities must match the regular expression "
                                 "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
        sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
        value = Fraction(number) * (-1 if sign == "-" else 1)
        if suffix in _BINARY_SUFFIXES[1:]:
            value, fmt = value * 1024 ** _BINARY_SUFFIXES.index(suffix), BINARY_SI
        elif suffix[:1] in ("e", "E"):
            value, fmt = value * Fraction(10) ** int(suffix[1:]), DECIMAL_EXPONENT
        else:
            value, fmt = value * Fraction(10) ** _DECIMAL_SUFFIXES[suffix], DECIMAL_SI
        if (value * 10 ** 9).denominator != 1:
            raise NotModelled(f"quantity {text!r}: finer than 1n (the real parser rounds it up)")
        return cls(value, fmt)

    def integer(self) -> int:
        """Quantity.Value: the value rounded up to an integer."""
        return -((-self.value.numerator) // self.value.denominator)

    def __str__(self) -> str:  # quantity.go CanonicalizeBytes
        if self.value == 0:
            return "0"
        fmt = self.format
        if fmt == BINARY_SI and (-1024 < self.value < 1024 or self.value.denominator != 1):
            fmt = DECIMAL_SI  # "This avoids rounding and hopefully confusion", "Don't lose precision"
        if fmt == BINARY_SI:  # amount.go AsCanonicalBase1024Bytes
            mantissa, exponent = int(self.value), 0
            while mantissa % 1024 == 0:
                mantissa, exponent = mantissa // 1024, exponent + 1
            if exponent >= len(_BINARY_SUFFIXES):
                raise NotModelled(f"quantity {self.value}: beyond Ei")
            return f"{mantissa}{_BINARY_SUFFIXES[exponent]}"
        mantissa, exponent = int(self.value * 10 ** 9), -9  # amount.go AsCanonicalBytes
        while mantissa % 10 == 0:
            mantissa, exponent = mantissa // 10, exponent + 1
        mantissa, exponent = mantissa * 10 ** (exponent % 3), exponent - exponent % 3
        if fmt == DECIMAL_EXPONENT:
            return f"{mantissa}e{exponent}" if exponent else str(mantissa)
        suffix = {power: name for name, power in _DECIMAL_SUFFIXES.items()}.get(exponent)
        if suffix is None:
            raise NotModelled(f"quantity {self.value}: beyond the decimal suffixes")
        return f"{mantissa}{suffix}"


# -- CEL (DRAL cel/compile.go): the forms gpud's documents and tests use ------------------------------

class CelRuntimeError(Exception):
    """An error of CEL's evaluation (cel-go's message)."""


@dataclass(frozen=True)
class Semver:
    """A version attribute: CEL's semver type, equal to no string."""
    text: str


@dataclass
class DeviceView:
    """The `device` a selector sees (cel/compile.go DeviceMatches): attributes and capacity by domain
    (an id without a domain is the driver's), attribute values as Python str/int/bool or Semver,
    capacities as Quantity. A Python selector gets this too."""
    driver: str
    allow_multiple_allocations: bool
    attributes: dict[str, dict[str, Any]]
    capacity: dict[str, dict[str, Quantity]]

    @classmethod
    def of(cls, device: dict, driver: str) -> DeviceView:
        attributes: dict[str, dict[str, Any]] = {}
        for name, attribute in (device.get("attributes") or {}).items():
            domain, ident = split_qualified_name(name, driver)
            attributes.setdefault(domain, {})[ident] = attribute_value(name, attribute)
        capacity: dict[str, dict[str, Quantity]] = {}
        for name, value in (device.get("capacity") or {}).items():
            domain, ident = split_qualified_name(name, driver)
            capacity.setdefault(domain, {})[ident] = Quantity.parse(value["value"])
        return cls(driver, bool(device.get("allowMultipleAllocations")), attributes, capacity)


def split_qualified_name(name: str, driver: str) -> tuple[str, str]:  # cel/compile.go parseQualifiedName
    domain, sep, ident = name.partition("/")
    return (domain, ident) if sep else (driver, name)


def attribute_value(name: str, attribute: dict) -> Any:  # cel/compile.go getAttributeValue
    kinds = [key for key in ("int", "bool", "string", "version") if key in attribute]
    if len(kinds) != 1:
        raise NotModelled(f"attribute {name}: {sorted(attribute)} (list-typed or unknown attribute values)")
    value = attribute[kinds[0]]
    return Semver(value) if kinds[0] == "version" else value


_TOKEN = re.compile(r"\s*(?:(?P<string>\"[^\"\\\n]*\"|'[^'\\\n]*')|(?P<int>\d+)|(?P<ident>[A-Za-z_]\w*)"
                    r"|(?P<op>&&|\|\||==|!=|<=|>=|[<>!().\[\]-]))")
_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")


class _CelParser:
    """Recursive descent over CEL's precedence (||, &&, relations, unary !), the accepted forms only."""

    def __init__(self, expression: str):
        self.expression = expression
        self.tokens: list[tuple[str, Any]] = []
        position = 0
        while position < len(expression.rstrip()):
            match = _TOKEN.match(expression, position)
            if match is None:
                self.refuse(f"at {position}")
            kind = match.lastgroup
            text = match.group(kind)
            self.tokens.append((kind, text[1:-1] if kind == "string" else int(text) if kind == "int" else text))
            position = match.end()
        self.at = 0

    def refuse(self, why: str):
        raise NotModelled(f"CEL expression not modelled ({why}): {self.expression}")

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, text: str | None = None, kind: str | None = None) -> Any:
        token = self.peek()
        if token is None or (text is not None and token != ("op", text) and token != ("ident", text)) \
                or (kind is not None and token[0] != kind):
            self.refuse(f"expected {text or kind}, found {token[1] if token else 'the end'}")
        self.at += 1
        return token[1]

    def parse(self) -> Callable[[DeviceView], Any]:
        node = self.disjunction()
        if self.peek() is not None:
            self.refuse(f"unexpected {self.peek()[1]}")
        return node

    def disjunction(self):
        operands = [self.conjunction()]
        while self.peek() == ("op", "||"):
            self.take("||")
            operands.append(self.conjunction())
        return operands[0] if len(operands) == 1 else _logical(operands, decisive=True)

    def conjunction(self):
        operands = [self.relation()]
        while self.peek() == ("op", "&&"):
            self.take("&&")
            operands.append(self.relation())
        return operands[0] if len(operands) == 1 else _logical(operands, decisive=False)

    def relation(self):
        left = self.unary()
        token = self.peek()
        if token is not None and token[0] == "op" and token[1] in _COMPARISONS:
            self.take(token[1])
            return _compare(token[1], left, self.unary())
        return left

    def unary(self):
        if self.peek() == ("op", "!"):
            self.take("!")
            operand = self.unary()

            def negate(device: DeviceView) -> bool:
                value = operand(device)
                if not isinstance(value, bool):
                    raise CelRuntimeError("no such overload")
                return not value
            return negate
        return self.primary()

    def primary(self):
        token = self.peek()
        if token == ("op", "("):
            self.take("(")
            node = self.disjunction()
            self.take(")")
            return node
        if token == ("op", "-"):
            self.take("-")
            number = -self.take(kind="int")
            return lambda device: number
        if token is not None and token[0] in ("string", "int"):
            self.at += 1
            return lambda device: token[1]
        if token in (("ident", "true"), ("ident", "false")):
            self.at += 1
            return lambda device: token[1] == "true"
        return self.member()

    def member(self):
        self.take("device")
        self.take(".")
        name = self.take(kind="ident")
        if name in ("driver", "allowMultipleAllocations"):
            fixed = {"driver": lambda device: device.driver,
                     "allowMultipleAllocations": lambda device: device.allow_multiple_allocations}[name]
            return fixed
        if name not in ("attributes", "capacity"):
            self.refuse(f"device.{name}")
        self.take("[")
        domain = self.take(kind="string")
        self.take("]")
        if self.peek() == ("op", "["):
            self.take("[")
            ident = self.take(kind="string")
            self.take("]")
        else:
            self.take(".")
            ident = self.take(kind="ident")

        def lookup(device: DeviceView) -> Any:
            values = getattr(device, name).get(domain, {})  # an unknown domain: an empty map
            if ident not in values:
                raise CelRuntimeError(f"no such key: {ident}")
            return values[ident]
        if self.peek() != ("op", "."):
            return lookup
        self.take(".")
        self.take("compareTo")
        self.take("(")
        self.take("quantity")
        self.take("(")
        other = Quantity.parse(self.take(kind="string"))
        self.take(")")
        self.take(")")

        def compare_to(device: DeviceView) -> int:
            value = lookup(device)
            if not isinstance(value, Quantity):
                raise CelRuntimeError("no such overload")
            return (value.value > other.value) - (value.value < other.value)
        return compare_to


def _logical(operands: list, decisive: bool):
    """CEL's commutative && (decisive False) and || (decisive True): the deciding value wins over an
    error on the other side; otherwise the first error."""
    def evaluate(device: DeviceView) -> bool:
        error = None
        for operand in operands:
            try:
                value = operand(device)
            except CelRuntimeError as exc:
                error = error or exc
                continue
            if not isinstance(value, bool):
                error = error or CelRuntimeError("no such overload")
            elif value is decisive:
                return decisive
        if error is not None:
            raise error
        return not decisive
    return evaluate


def _compare(op: str, left, right):
    def evaluate(device: DeviceView) -> bool:
        a, b = left(device), right(device)
        if op in ("==", "!="):  # heterogeneous equality: values of different types are not equal
            same = type(a) is type(b) and a == b
            return same if op == "==" else not same
        if type(a) is not type(b) or not isinstance(a, (int, str)) or isinstance(a, bool):
            raise CelRuntimeError("no such overload")
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
    return evaluate


_CEL_CACHE: dict[str, Callable[[DeviceView], Any]] = {}


def compile_cel(expression: str) -> Callable[[DeviceView], Any]:
    if expression not in _CEL_CACHE:
        _CEL_CACHE[expression] = _CelParser(expression).parse()
    return _CEL_CACHE[expression]


def selector_matches(selector: Any, device: DeviceView) -> bool:
    """One selector: a Python predicate over the DeviceView, or {"cel": {"expression": ...}}."""
    if callable(selector):
        return bool(selector(device))
    expression = (selector or {}).get("cel", {}).get("expression") if isinstance(selector, dict) else None
    if not isinstance(expression, str):
        raise _SelectorError("CEL expression empty (unsupported selector type?)")
    result = compile_cel(expression)(device)
    if not isinstance(result, bool):
        raise CelRuntimeError(f"CEL result of type {type(result).__name__} could not be converted to bool")
    return result


class _SelectorError(Exception):
    pass


# -- features and rules of each version ---------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    """internal/types.go Features, as the scheduler sets them from its gates."""
    admin_access: bool = True
    prioritized_list: bool = True
    partitionable_devices: bool = False
    device_taints: bool = False
    consumable_capacity: bool = False

    @classmethod
    def of(cls, server_version: str, gates: dict[str, bool] | None = None) -> Features:
        Rules.of(server_version)
        defaults = default_gates(server_version)
        unknown = set(gates or {}) - set(defaults) - {"DRAAdminAccess", "DRAPrioritizedList"}
        if unknown:
            raise ValueError(f"unknown gates {sorted(unknown)}")
        on = {**defaults, **(gates or {})}
        return cls(admin_access=on.get("DRAAdminAccess", True), prioritized_list=on.get("DRAPrioritizedList", True),
                   partitionable_devices=on["DRAPartitionableDevices"], device_taints=on["DRADeviceTaints"],
                   consumable_capacity=on["DRAConsumableCapacity"])


@dataclass(frozen=True)
class Rules:
    """What differs between the releases of DRAL the stand-in follows."""
    counters_per_slice: bool  # 1.34: counter sets in the device's own slice
    skip_unusable_pools: bool  # 1.35+: incomplete and invalid pools skipped, not an error
    shared_devices_consume_counters: bool  # 1.36: IsDeviceAllocated counts shared devices
    skip_counter_check_when_shared: bool  # 1.35+: skipCounterCheck
    only_blocking_taints: bool  # 1.35+: taintPreventsAllocation (NoSchedule, NoExecute)

    @classmethod
    def of(cls, server_version: str) -> Rules:
        if server_version not in SERVER_VERSIONS:
            raise ValueError(f"server_version {server_version!r}: one of {', '.join(SERVER_VERSIONS)}")
        v134, v136 = server_version == "1.34", server_version == "1.36"
        return cls(counters_per_slice=v134, skip_unusable_pools=not v134, shared_devices_consume_counters=v136,
                   skip_counter_check_when_shared=not v134, only_blocking_taints=not v134)


# -- pools (pools_incubating.go) -----------------------------------------------------------------------

@dataclass
class Pool:
    driver: str
    name: str
    incomplete: bool = False
    invalid_reason: str = ""
    slices: list[dict] = field(default_factory=list)  # DeviceSlicesTargetingNode
    slices_elsewhere: list[dict] = field(default_factory=list)  # DeviceSlicesNotTargetingNode
    counter_sets: dict[str, dict[str, Fraction]] = field(default_factory=dict)

    @property
    def id(self) -> str:  # PoolID.String
        return f"{self.driver}/{self.name}"


def _counter_set(counter_set: dict) -> dict[str, Fraction]:
    return {name: Quantity.parse(counter["value"]).value for name, counter in counter_set["counters"].items()}


def _refuse_unmodelled_slice(slice_: dict) -> None:
    spec = slice_["spec"]
    if spec.get("nodeSelector") is not None or spec.get("perDeviceNodeSelection") is not None:
        raise NotModelled(f"slice {slice_['metadata']['name']}: nodeSelector / perDeviceNodeSelection")
    for device in spec.get("devices") or []:
        if device.get("bindingConditions") or device.get("bindsToNode"):
            raise NotModelled(f"device {device['name']}: bindingConditions / bindsToNode")


def gather_pools(slices: list[dict], node: str, features: Features, rules: Rules) -> list[Pool]:
    """GatherPools: the pools with devices for `node`, sorted by driver and name."""
    for slice_ in slices:
        _refuse_unmodelled_slice(slice_)
    if rules.counters_per_slice:  # v0.34: every slice, no special case for counter slices
        candidates = slices
    else:  # NewAllocator: slicesOnNode[node] then slicesShared
        candidates = [s for s in slices if s["spec"].get("nodeName") == node and not s["spec"].get("sharedCounters")]
        candidates += [s for s in slices if not s["spec"].get("nodeName") or s["spec"].get("sharedCounters")]
    grouped: dict[tuple[str, str], list[dict]] = {}
    for slice_ in candidates:
        spec = slice_["spec"]
        if not features.partitionable_devices and not rules.counters_per_slice and spec.get("sharedCounters"):
            continue
        if spec.get("sharedCounters") and not rules.counters_per_slice:
            relevant = True
        elif spec.get("nodeName"):
            relevant = spec["nodeName"] == node
        elif spec.get("allNodes"):
            relevant = True
        else:
            continue  # "Nothing known was set."
        if relevant:
            _add_slice(grouped, slice_)
    pools = []
    for (driver, name), pool_slices in grouped.items():
        wanted = pool_slices[0]["spec"]["pool"]["resourceSliceCount"]
        if rules.counters_per_slice:  # v0.34: counted among the relevant slices only
            pool = _build_pool_134(driver, name, pool_slices)
            pool.incomplete = len(pool_slices) != wanted
            pools.append(pool)
            continue
        if len(pool_slices) == wanted:
            pools.append(_build_pool(driver, name, pool_slices, features, None))
            continue
        generation = pool_slices[0]["spec"]["pool"]["generation"]
        same_pool = [s for s in slices if (s["spec"]["driver"], s["spec"]["pool"]["name"]) == (driver, name)]
        if any(s["spec"]["pool"]["generation"] > generation for s in same_pool):
            continue  # checkSlicesInPool: obsolete, a newer generation is being published
        all_slices = [s for s in same_pool if s["spec"]["pool"]["generation"] == generation]
        if len(all_slices) != wanted:
            pools.append(Pool(driver, name, incomplete=True))
            continue
        pools.append(_build_pool(driver, name, pool_slices, features, all_slices))
    return sorted(pools, key=lambda p: (p.driver, p.name))


def _add_slice(grouped: dict[tuple[str, str], list[dict]], slice_: dict) -> None:  # addSlice
    key = (slice_["spec"]["driver"], slice_["spec"]["pool"]["name"])
    generation = slice_["spec"]["pool"]["generation"]
    current = grouped.get(key)
    if current is None or generation > current[0]["spec"]["pool"]["generation"]:
        grouped[key] = [slice_]
    elif generation == current[0]["spec"]["pool"]["generation"]:
        current.append(slice_)


def _duplicate_device(slices: list[dict]) -> str:  # validateDeviceNames
    seen: set[str] = set()
    for slice_ in slices:
        for device in slice_["spec"].get("devices") or []:
            if device["name"] in seen:
                return f"duplicate device name {device['name']}"
            seen.add(device["name"])
    return ""


def _build_pool_134(driver: str, name: str, slices: list[dict]) -> Pool:  # v0.34.9 poolIsInvalid
    ordered = sorted(slices, key=lambda s: s["metadata"]["name"])
    return Pool(driver, name, invalid_reason=_duplicate_device(ordered), slices=ordered)


def _build_pool(driver: str, name: str, slices: list[dict], features: Features,
                all_slices: list[dict] | None) -> Pool:  # buildPool
    ordered = sorted(slices, key=lambda s: s["metadata"]["name"])
    if features.partitionable_devices:
        counter_slices = [s for s in ordered if s["spec"].get("sharedCounters")]
        device_slices = [s for s in ordered if not s["spec"].get("sharedCounters")]
    else:
        counter_slices, device_slices = [], ordered
    reason = _duplicate_device(device_slices)
    if reason or not features.partitionable_devices:
        return Pool(driver, name, invalid_reason=reason, slices=device_slices)
    counter_sets: dict[str, dict[str, Fraction]] = {}
    for slice_ in counter_slices:  # getAndValidateCounterSets
        for counter_set in slice_["spec"]["sharedCounters"]:
            if counter_set["name"] in counter_sets:
                return Pool(driver, name, invalid_reason=f"duplicate counter set name {counter_set['name']}")
            counter_sets[counter_set["name"]] = _counter_set(counter_set)
    reason = _unknown_counters(counter_sets, ordered)
    if reason:
        return Pool(driver, name, invalid_reason=reason)
    names = {s["metadata"]["name"] for s in ordered}
    elsewhere = [s for s in all_slices or [] if s["metadata"]["name"] not in names]
    reason = _unknown_counters(counter_sets, elsewhere)
    if reason:
        return Pool(driver, name, invalid_reason=reason)
    return Pool(driver, name, slices=device_slices, slices_elsewhere=elsewhere, counter_sets=counter_sets)


def _unknown_counters(counter_sets: dict[str, dict[str, Fraction]], slices: list[dict]) -> str:
    for slice_ in slices:  # validateDeviceCounterConsumption
        for device in slice_["spec"].get("devices") or []:
            for consumption in device.get("consumesCounters") or []:
                counter_set = counter_sets.get(consumption["counterSet"])
                if counter_set is None:
                    return f"counter set {consumption['counterSet']} not found"
                for counter in consumption["counters"]:
                    if counter not in counter_set:
                        return f"counter {counter} not found in counter set {consumption['counterSet']}"
    return ""


# -- what is allocated (plugin/allocateddevices.go) ---------------------------------------------------

DeviceID = tuple[str, str, str]  # driver, pool, device


@dataclass
class AllocatedState:
    """schedulerapi/types.go AllocatedState."""
    devices: set[DeviceID] = field(default_factory=set)
    shared: set[tuple[DeviceID, str]] = field(default_factory=set)
    capacity: dict[DeviceID, dict[str, Fraction]] = field(default_factory=dict)

    @classmethod
    def of(cls, claims: list[dict], features: Features) -> AllocatedState:
        state = cls()
        for claim in claims:
            allocation = (claim.get("status") or {}).get("allocation")
            for result in (allocation or {}).get("devices", {}).get("results") or []:
                if result.get("adminAccess"):
                    continue
                device_id = (result["driver"], result["pool"], result["device"])
                if features.consumable_capacity and result.get("shareID") is not None:
                    state.shared.add((device_id, result["shareID"]))
                    if result.get("consumedCapacity") is not None:
                        _add_capacity(state.capacity, device_id, {
                            name: Quantity.parse(value).value for name, value in result["consumedCapacity"].items()})
                    continue
                state.devices.add(device_id)
        return state

    def is_allocated(self, device_id: DeviceID, count_shared: bool) -> bool:  # IsDeviceAllocated
        if device_id in self.devices:
            return True
        return count_shared and (any(shared == device_id for shared, _ in self.shared) or device_id in self.capacity)


def _add_capacity(collection: dict[DeviceID, dict[str, Fraction]], device_id: DeviceID,
                  consumed: dict[str, Fraction]) -> None:  # ConsumedCapacityCollection.Insert
    entry = collection.setdefault(device_id, {})
    for name, value in consumed.items():
        entry[name] = entry.get(name, Fraction(0)) + value


def _remove_capacity(collection: dict[DeviceID, dict[str, Fraction]], device_id: DeviceID,
                     consumed: dict[str, Fraction]) -> None:  # ConsumedCapacityCollection.Remove
    entry = collection.get(device_id)
    if entry is None:
        return
    for name, value in consumed.items():
        if name in entry:
            entry[name] -= value
    if all(value == 0 for value in entry.values()):
        del collection[device_id]


# -- consumable capacity (incubating/consumable_capacity.go) ------------------------------------------

def _requested(request: dict, name: str) -> Quantity | None:
    value = ((request.get("capacity") or {}).get("requests") or {}).get(name)
    return None if value is None else Quantity.parse(value)


def consumed_capacity(requested: Quantity | None, capacity: dict) -> Quantity:  # calculateConsumedCapacity
    policy = capacity.get("requestPolicy")
    if requested is None:  # fillEmptyRequest
        if policy is not None and policy.get("default") is not None:
            return Quantity.parse(policy["default"])
        return Quantity.parse(capacity["value"])
    if policy is None:
        return requested
    valid_range = policy.get("validRange")
    if valid_range is not None and valid_range.get("min") is not None:  # roundUpRange
        minimum = Quantity.parse(valid_range["min"])
        if requested.value < minimum.value:
            return minimum
        if valid_range.get("step") is None:
            return requested
        step, low = Quantity.parse(valid_range["step"]).integer(), minimum.integer()
        n, remainder = divmod(requested.integer() - low, step)
        return Quantity(Fraction(low + step * (n + (1 if remainder else 0))), BINARY_SI)
    if policy.get("validValues") is not None:  # roundUpValidValues
        for value in policy["validValues"]:
            if requested.value <= Quantity.parse(value).value:
                return Quantity.parse(value)
    return requested


def violates_policy(value: Quantity, policy: dict | None) -> bool:  # violatesPolicy
    if policy is None:
        return False
    if policy.get("default") is not None and value.value == Quantity.parse(policy["default"]).value:
        return False
    valid_range = policy.get("validRange")
    if valid_range is not None:  # violateValidRange
        if valid_range.get("max") is not None and value.value > Quantity.parse(valid_range["max"]).value:
            return True
        if valid_range.get("step") is not None:
            step = Quantity.parse(valid_range["step"]).integer()
            return (value.integer() - Quantity.parse(valid_range["min"]).integer()) % step != 0
        return False
    if policy.get("validValues"):  # violateValidValues
        return all(value.value != Quantity.parse(v).value for v in policy["validValues"])
    return False


def fits_capacity(already: dict[str, Fraction], request: dict, device: dict,
                  allocating: dict[str, Fraction]) -> bool:
    """CmpRequestOverCapacity; a request naming a capacity the device lacks is the real one's error,
    which its callers treat as unsuitable."""
    capacities = device.get("capacity") or {}
    if any(name not in capacities for name in (request.get("capacity") or {}).get("requests") or {}):
        return False
    for name, capacity in capacities.items():
        value = consumed_capacity(_requested(request, name), capacity)
        if violates_policy(value, capacity.get("requestPolicy")):
            return False
        total = already.get(name, Fraction(0)) + value.value + allocating.get(name, Fraction(0))
        if total > Quantity.parse(capacity["value"]).value:
            return False
    return True


# -- the allocator -------------------------------------------------------------------------------------

@dataclass
class _Request:
    """requestData: one request, or one subrequest of a firstAvailable request."""
    name: str
    parent: str | None
    spec: dict  # the exactly / subrequest body
    class_name: str
    class_: dict
    count: int = 0
    all_devices: list[tuple[Pool, dict, dict]] | None = None

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    @property
    def admin_access(self) -> bool:
        return self.parent is None and bool(self.spec.get("adminAccess"))


@dataclass
class _Result:
    request: _Request
    device_id: DeviceID
    slice_: dict
    share_id: str | None
    consumed: dict[str, Quantity] | None


class _MaxSizeExceeded(Exception):
    """errAllocationResultMaxSizeExceeded."""


class _Allocation:
    def __init__(self, claims: list[dict], slices: list[dict], allocated: list[dict], node: str,
                 classes: dict[str, dict], features: Features, rules: Rules):
        self.claims, self.node, self.features, self.rules = claims, node, features, rules
        self.state = AllocatedState.of(allocated, features)
        self.pools = gather_pools(slices, node, features, rules)
        self.requests: dict[tuple[int, int, int], _Request] = {}
        self.selected_subrequest: dict[tuple[int, int], int] = {}
        self.allocating: dict[DeviceID, set[int]] = {}
        self.allocating_capacity: dict[DeviceID, dict[str, Fraction]] = {}
        self.available_counters: dict[str, dict[str, dict[str, Fraction]]] = {}
        self.consumed_counters: dict[str, dict[str, dict[str, Fraction]]] = {}
        self.matches: dict[tuple, bool] = {}
        self.results: list[list[_Result]] = [[] for _ in claims]
        for claim_index, claim in enumerate(claims):
            self._check_claim(claim_index, claim, classes)

    def _who(self, claim_index: int) -> str:  # klog.KObj
        meta = self.claims[claim_index]["metadata"]
        return f"{meta['namespace']}/{meta['name']}"

    def _check_claim(self, claim_index: int, claim: dict, classes: dict[str, dict]) -> None:  # Allocate
        devices = claim["spec"]["devices"]
        if devices.get("constraints"):
            raise NotModelled("claim constraints (matchAttribute, distinctAttribute)")
        minimum = 0
        for request_index, request in enumerate(devices["requests"]):
            subrequests = request.get("firstAvailable") or []
            if subrequests and not self.features.prioritized_list:
                raise AllocatorError(f"claim {self._who(claim_index)}, request {request['name']}: has subrequests, "
                                     "but the DRAPrioritizedList feature is disabled")
            if not self.features.consumable_capacity:
                if request.get("exactly", {}).get("capacity") is not None:
                    raise AllocatorError(f"claim {self._who(claim_index)}, request {request['name']}: has capacity "
                                         "requests, but the DRAConsumableCapacity feature is disabled")
                for sub in subrequests:
                    if sub.get("capacity") is not None:
                        raise AllocatorError(f"claim {self._who(claim_index)}, subrequest {sub['name']}: has "
                                             "capacity requests, but the DRAConsumableCapacity feature is disabled")
            if subrequests:
                counts = []
                for sub_index, sub in enumerate(subrequests):
                    data = self._check_request(claim_index, sub["name"], request["name"], sub, classes,
                                               (claim_index, request_index, sub_index))
                    counts.append(data.count)
                minimum += min(counts)
            else:
                data = self._check_request(claim_index, request["name"], None, request["exactly"], classes,
                                           (claim_index, request_index, 0))
                minimum += data.count
        if minimum > ALLOCATION_RESULTS_MAX_SIZE:
            raise AllocatorError(f"claim {self._who(claim_index)}: number of requested devices {minimum} exceeds "
                                 f"the claim limit of {ALLOCATION_RESULTS_MAX_SIZE}")

    def _check_request(self, claim_index: int, name: str, parent: str | None, spec: dict,
                       classes: dict[str, dict], key: tuple[int, int, int]) -> _Request:  # validateDeviceRequest
        who = f"claim {self._who(claim_index)}, request {name}"
        for i, selector in enumerate(spec.get("selectors") or []):
            if not callable(selector) and not isinstance((selector or {}).get("cel"), dict):
                raise AllocatorError(f"{who}, selector #{i}: CEL expression empty (unsupported selector type?)")
        if not self.features.admin_access and parent is None and spec.get("adminAccess") is not None:
            raise AllocatorError(f"{who}: admin access is requested, but the feature is disabled")
        class_name = spec.get("deviceClassName") or ""
        if not class_name:
            raise AllocatorError(f"{who}: missing device class name (unsupported request type?)")
        if class_name not in classes:
            raise AllocatorError(f"{who}: could not retrieve device class {class_name}: "
                                 f'deviceclass.resource.k8s.io "{class_name}" not found')
        data = _Request(name, parent, spec, class_name, classes[class_name])
        self.requests[key] = data
        mode = spec.get("allocationMode", "ExactCount")
        if mode == "ExactCount":
            data.count = int(spec.get("count", 1))
        elif mode == "All":
            data.all_devices = []
            for pool in self.pools:
                if pool.incomplete:
                    raise AllocatorError(f"{who}: asks for all devices, but resource pool {pool.id} is currently "
                                         "being updated")
                if pool.invalid_reason:
                    raise AllocatorError(f"{who}: asks for all devices, but resource pool {pool.id} is currently "
                                         "invalid")
                for slice_ in pool.slices:
                    for device in slice_["spec"].get("devices") or []:
                        if self._selectable(key, data, pool, device) and (
                                not self.features.consumable_capacity or self._fits(data, pool, device)):
                            data.all_devices.append((pool, slice_, device))
            data.count = len(data.all_devices)
        else:
            raise AllocatorError(f"{who}: unsupported count mode {mode}")
        return data

    # -- the search (allocateOne) --

    def run(self) -> bool:
        try:
            return self._allocate_one((0, 0, 0, 0), False, (0, 0, 0))
        except _MaxSizeExceeded:  # not swallowed above the first claim: Allocate returns it
            raise AllocatorError("allocation max size exceeded") from None

    def _allocate_one(self, r: tuple[int, int, int, int], in_subrequest: bool, start: tuple[int, int, int]) -> bool:
        claim_index, request_index, sub_index, device_index = r
        if claim_index >= len(self.claims):
            return True
        requests = self.claims[claim_index]["spec"]["devices"]["requests"]
        if request_index >= len(requests):
            try:
                return self._allocate_one((claim_index + 1, 0, 0, 0), False, (0, 0, 0))
            except _MaxSizeExceeded:
                return False
        data = self.requests[(claim_index, request_index, sub_index)]
        if not in_subrequest and data.parent is not None:
            all_exceeded = True
            for sub in range(len(requests[request_index]["firstAvailable"])):
                try:
                    if self._allocate_one((claim_index, request_index, sub, 0), True, (0, 0, 0)):
                        self.selected_subrequest[(claim_index, request_index)] = sub
                        return True
                    all_exceeded = False
                except _MaxSizeExceeded:
                    continue
            if all_exceeded:
                raise _MaxSizeExceeded()
            return False
        everything = data.all_devices is not None
        if everything and not data.all_devices:
            return False
        if device_index >= data.count:
            return self._allocate_one((claim_index, request_index + 1, 0, 0), False, (0, 0, 0))
        if len(self.results[claim_index]) + data.count - device_index > ALLOCATION_RESULTS_MAX_SIZE:
            raise _MaxSizeExceeded()
        following = (claim_index, request_index, sub_index, device_index + 1)
        if everything:
            pool, slice_, device = data.all_devices[device_index]
            rollback = self._allocate_device(r, data, pool, slice_, device)
            if rollback is None:
                return False
            try:
                done = self._allocate_one(following, in_subrequest, (0, 0, 0))
            except BaseException:
                rollback()
                raise
            if not done:
                rollback()
            return done
        for pool_index in range(start[0], len(self.pools)):
            pool = self.pools[pool_index]
            if self.rules.skip_unusable_pools and (pool.incomplete or pool.invalid_reason):
                continue
            if pool.invalid_reason:
                raise AllocatorError(f"pool {pool.name} is invalid: {pool.invalid_reason}")
            first_slice = start[1] if pool_index == start[0] else 0
            for slice_index in range(first_slice, len(pool.slices)):
                slice_ = pool.slices[slice_index]
                devices = slice_["spec"].get("devices") or []
                first_device = start[2] if (pool_index, slice_index) == start[:2] else 0
                for index in range(first_device, len(devices)):
                    device = devices[index]
                    device_id = (pool.driver, pool.name, device["name"])
                    if data.admin_access and claim_index in self.allocating.get(device_id, ()):
                        continue
                    if not data.admin_access and self._in_use(device_id):
                        continue
                    if not self._selectable(r[:3], data, pool, device):
                        continue
                    if self.features.consumable_capacity and not self._fits(data, pool, device):
                        continue
                    rollback = self._allocate_device(r, data, pool, slice_, device)
                    if rollback is None:
                        continue
                    try:
                        done = self._allocate_one(following, in_subrequest, (pool_index, slice_index, index + 1))
                    except BaseException:
                        rollback()
                        raise
                    if done:
                        return True
                    rollback()
        return False

    def _in_use(self, device_id: DeviceID) -> bool:  # deviceInUse
        return device_id in self.state.devices or bool(self.allocating.get(device_id))

    def _capacity_in_use(self, device_id: DeviceID) -> bool:  # deviceCapacityInUse
        return device_id in self.state.capacity or device_id in self.allocating_capacity

    def _selectable(self, key: tuple[int, int, int], data: _Request, pool: Pool, device: dict) -> bool:
        """isSelectable: the class's selectors, then the request's (cached per device and request)."""
        match_key = (pool.driver, pool.name, device["name"], key)
        if match_key not in self.matches:
            view = DeviceView.of(device, pool.driver)
            self.matches[match_key] = (
                self._selectors_match(key[0], view, data.class_name, data.class_.get("spec", {}).get("selectors") or [])
                and self._selectors_match(key[0], view, None, data.spec.get("selectors") or []))
        return self.matches[match_key]

    def _selectors_match(self, claim_index: int, view: DeviceView, class_name: str | None, selectors: list) -> bool:
        for i, selector in enumerate(selectors):  # selectorsMatch
            where = f"class {class_name}" if class_name is not None else f"claim {self._who(claim_index)}"
            try:
                if not selector_matches(selector, view):
                    return False
            except _SelectorError as exc:
                raise AllocatorError(f"{where}: selector #{i}: {exc}") from None
            except CelRuntimeError as exc:
                raise AllocatorError(f"{where}: selector #{i}: CEL runtime error: {exc}") from None
        return True

    def _fits(self, data: _Request, pool: Pool, device: dict) -> bool:  # allocator.CmpRequestOverCapacity
        device_id = (pool.driver, pool.name, device["name"])
        return fits_capacity(self.state.capacity.get(device_id, {}), data.spec, device,
                             self.allocating_capacity.get(device_id, {}))

    def _allocate_device(self, r: tuple[int, int, int, int], data: _Request, pool: Pool, slice_: dict,
                         device: dict) -> Callable[[], None] | None:
        """allocateDevice: None when the device cannot be taken, else the rollback."""
        claim_index = r[0]
        device_id = (pool.driver, pool.name, device["name"])
        shareable = self.features.consumable_capacity and bool(device.get("allowMultipleAllocations"))
        if not shareable and data.admin_access and claim_index in self.allocating.get(device_id, ()):
            return None
        if not data.admin_access and self._in_use(device_id):
            return None
        consumes = device.get("consumesCounters") or []
        if not self.features.partitionable_devices and consumes:
            return None
        skip_counters = (self.rules.skip_counter_check_when_shared and shareable
                         and self._capacity_in_use(device_id))
        if not skip_counters and consumes and not self._take_counters(pool, slice_, device):
            return None
        if self.features.device_taints and self._untolerated(device, data):
            return None
        self.allocating.setdefault(device_id, set())
        if not shareable:
            self.allocating[device_id].add(claim_index)
        share_id, consumed = None, None
        if self.features.consumable_capacity:
            if not self._fits(data, pool, device):
                return None  # the real one returns here too, its counters and in-use mark left as they are
            if shareable:
                consumed = {name: consumed_capacity(_requested(data.spec, name), capacity)
                            for name, capacity in (device.get("capacity") or {}).items()}
                share_id = str(uuid.uuid4())
                _add_capacity(self.allocating_capacity, device_id, {n: q.value for n, q in consumed.items()})
        self.results[claim_index].append(_Result(data, device_id, slice_, share_id, consumed or None))
        length = len(self.results[claim_index]) - 1

        def rollback() -> None:
            self.allocating[device_id].discard(claim_index)
            if shareable:
                if consumed:
                    _remove_capacity(self.allocating_capacity, device_id, {n: q.value for n, q in consumed.items()})
            elif self.features.partitionable_devices and consumes:
                self._give_counters(pool, slice_, device)
            del self.results[claim_index][length:]
        return rollback

    def _untolerated(self, device: dict, data: _Request) -> bool:  # taintPreventsAllocation / allTaintsTolerated
        for taint in device.get("taints") or []:
            if self.rules.only_blocking_taints and taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any(_tolerates(toleration, taint) for toleration in data.spec.get("tolerations") or []):
                return True
        return False

    def _counter_key(self, pool: Pool, slice_: dict) -> str:
        return slice_["metadata"]["name"] if self.rules.counters_per_slice else pool.name

    def _take_counters(self, pool: Pool, slice_: dict, device: dict) -> bool:  # checkAvailableCounters
        key = self._counter_key(pool, slice_)
        if key not in self.available_counters:
            if self.rules.counters_per_slice:
                available = {s["name"]: _counter_set(s) for s in slice_["spec"].get("sharedCounters") or []}
                neighbours = [slice_]
            else:
                available = {name: dict(counters) for name, counters in pool.counter_sets.items()}
                neighbours = pool.slices + pool.slices_elsewhere
            for other in neighbours:
                for other_device in other["spec"].get("devices") or []:
                    other_id = (other["spec"]["driver"], other["spec"]["pool"]["name"], other_device["name"])
                    if not self.state.is_allocated(other_id, self.rules.shared_devices_consume_counters):
                        continue
                    for consumption in other_device.get("consumesCounters") or []:
                        counter_set = available.get(consumption["counterSet"], {})
                        for name, counter in consumption["counters"].items():
                            if name in counter_set:
                                counter_set[name] -= Quantity.parse(counter["value"]).value
            self.available_counters[key] = available
        available = self.available_counters[key]
        consumed = self.consumed_counters.setdefault(key, {})
        for consumption in device["consumesCounters"]:
            counter_set = consumed.setdefault(consumption["counterSet"], {})
            for name, counter in consumption["counters"].items():
                counter_set[name] = counter_set.get(name, Fraction(0)) + Quantity.parse(counter["value"]).value
        for set_name, counters in available.items():
            for name, value in counters.items():
                if value < consumed.get(set_name, {}).get(name, Fraction(0)):
                    self._give_counters(pool, slice_, device)
                    return False
        return True

    def _give_counters(self, pool: Pool, slice_: dict, device: dict) -> None:  # deallocateCountersForDevice
        consumed = self.consumed_counters[self._counter_key(pool, slice_)]
        for consumption in device["consumesCounters"]:
            for name, counter in consumption["counters"].items():
                consumed[consumption["counterSet"]][name] -= Quantity.parse(counter["value"]).value

    # -- the result (Allocate, createNodeSelector) --

    def allocation(self, claim_index: int) -> dict:
        claim = self.claims[claim_index]
        results = []
        for result in self.results[claim_index]:
            entry: dict[str, Any] = {"request": result.request.full_name, "driver": result.device_id[0],
                                     "pool": result.device_id[1], "device": result.device_id[2]}
            if result.request.admin_access:
                entry["adminAccess"] = True
            if result.request.spec.get("tolerations"):
                entry["tolerations"] = copy.deepcopy(result.request.spec["tolerations"])
            if result.share_id is not None:
                entry["shareID"] = result.share_id
            if result.consumed:
                entry["consumedCapacity"] = {name: str(value) for name, value in result.consumed.items()}
            results.append(entry)
        devices: dict[str, Any] = {"results": results}
        config = self._config(claim_index, claim)
        if config:
            devices["config"] = config
        allocation: dict[str, Any] = {"devices": devices}
        if any(result.slice_["spec"].get("nodeName") for result in self.results[claim_index]):
            allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [self.node]}]}]}
        return allocation

    def _chosen(self, claim_index: int, request_index: int) -> _Request:
        sub = self.selected_subrequest.get((claim_index, request_index), 0)
        return self.requests[(claim_index, request_index, sub)]

    def _config(self, claim_index: int, claim: dict) -> list[dict]:
        config: list[dict] = []
        class_configs: dict[str, tuple[int, int]] = {}
        requests = claim["spec"]["devices"]["requests"]
        for request_index in range(len(requests)):
            data = self._chosen(claim_index, request_index)
            class_name = data.class_name
            if class_name in class_configs:
                start, end = class_configs[class_name]
                for entry in config[start:end]:
                    entry["requests"].append(data.full_name)
                continue
            start = len(config)
            for class_config in data.class_.get("spec", {}).get("config") or []:
                config.append({"source": "FromClass", "requests": [data.full_name],
                               **copy.deepcopy({k: v for k, v in class_config.items() if k != "requests"})})
            class_configs[class_name] = (start, len(config))
        for claim_config in claim["spec"]["devices"].get("config") or []:
            body = copy.deepcopy({k: v for k, v in claim_config.items() if k != "requests"})
            named = claim_config.get("requests") or []
            if not named:
                config.append({"source": "FromClaim", **body})
                continue
            for request_index, request in enumerate(requests):
                data = self._chosen(claim_index, request_index)
                if request["name"] in named or (data.parent is not None and data.full_name in named):
                    config.append({"source": "FromClaim", "requests": list(named), **copy.deepcopy(body)})
        return config


def _tolerates(toleration: dict, taint: dict) -> bool:  # resourceclaim/devicetoleration.go ToleratesTaint
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator", "")
    if operator in ("", "Equal"):
        return toleration.get("value", "") == taint.get("value", "")
    return operator == "Exists"


def allocate_claims(slices: list[dict], claims: list[dict], allocated: list[dict], node: str,
                    classes: dict[str, dict], server_version: str = "1.36",
                    gates: dict[str, bool] | None = None) -> list[dict]:
    """Allocate a pod's claims together on `node`, as the scheduler's Filter does: one allocation
    (status.allocation) per claim, in order. `allocated` are the claims already allocated (any node),
    `classes` the DeviceClasses by name, `gates` overrides the server version's default feature gates."""
    for claim in claims:
        if (claim.get("status") or {}).get("allocation"):
            raise ValueError(f"claim {claim['metadata']['name']} is already allocated")
    search = _Allocation(claims, slices, allocated, node, classes, Features.of(server_version, gates),
                         Rules.of(server_version))
    if not search.run():
        if any(pool.invalid_reason for pool in search.pools) and search.rules.skip_unusable_pools:
            raise Unschedulable(INVALID_POOLS)
        raise Unschedulable(CANNOT_ALLOCATE)
    return [search.allocation(index) for index in range(len(claims))]


def allocate(slices: list[dict], claim: dict, allocated: list[dict], node: str, classes: dict[str, dict],
             server_version: str = "1.36", gates: dict[str, bool] | None = None) -> dict:
    """The claim's status.allocation on `node`; raises Unschedulable, AllocatorError or NotModelled."""
    return allocate_claims(slices, [claim], allocated, node, classes, server_version, gates)[0]


def claim_document(namespace: str, name: str, requests: list[dict], config: list[dict] | None = None) -> dict:
    """An unallocated ResourceClaim as the stand-in API server stores it (its requests defaulted by
    KubeApiStandIn's own helper)."""
    devices: dict[str, Any] = {"requests": [KubeApiStandIn._claim_request(r) for r in requests]}
    if config:
        devices["config"] = copy.deepcopy(config)
    return {"metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"devices": devices}, "status": {}}


def allocated_claim(claim: dict, allocation: dict) -> dict:
    """The claim with its allocation, for the `allocated` list of a later call."""
    done = copy.deepcopy(claim)
    done["status"] = {"allocation": copy.deepcopy(allocation)}
    return done


def store(api: KubeApiStandIn, claim: dict, allocation: dict, node: str) -> dict:
    """Record the allocation on the stand-in API server, as the scheduler's PreBind writes it."""
    meta = claim["metadata"]
    return api.set_claim_allocation(meta["namespace"], meta["name"], allocation["devices"]["results"],
                                    allocation["devices"].get("config"),
                                    node=node if "nodeSelector" in allocation else None)
