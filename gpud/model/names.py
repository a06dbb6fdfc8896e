"""Names Kubernetes and the device plugin's config directory accept, checked where gpud's config is read
and where the sharing configs are listed."""

from __future__ import annotations

import re

# Kubernetes' IsDNS1123Subdomain (k8s.io/apimachinery pkg/util/validation)
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_MAX_DNS_SUBDOMAIN_LENGTH = 253


def is_dns_subdomain(name: str) -> bool:
    """A lower-case DNS subdomain of at most 253 characters."""
    return len(name) <= _MAX_DNS_SUBDOMAIN_LENGTH and _DNS_SUBDOMAIN.fullmatch(name) is not None


# A ConfigMap key (Kubernetes' IsConfigMapKey): what the kubelet makes a file of.
_CONFIG_NAME = re.compile(r"[-._a-zA-Z0-9]+")
MAX_CONFIG_NAME_LENGTH = 253


def config_name_problem(name: str) -> str | None:
    """Why `name` cannot name a config in the directory, or None when it can."""
    if not name:
        return "a config name must not be empty"
    if len(name) > MAX_CONFIG_NAME_LENGTH:
        return f"a config name has at most {MAX_CONFIG_NAME_LENGTH} characters, got {len(name)}"
    if not _CONFIG_NAME.fullmatch(name):
        return f"a config name is a ConfigMap key (letters, digits, '-', '_', '.'), got {name[:80]!r}"
    if name.startswith(".."):  # '..' itself, and the kubelet's own '..data' and '..<timestamp>' entries
        return f"{name[:80]!r} is not a config name: names starting with '..' are the ConfigMap's own entries"
    if name == ".":
        return "'.' is not a config name"
    return None


def check_config_name(name: str) -> str:
    """The name, or ValueError saying why it cannot name a config (for sharing.default_config)."""
    problem = config_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


# Kubernetes' IsQualifiedName (k8s.io/apimachinery pkg/util/validation): the name after the prefix.
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_MAX_QUALIFIED_NAME_LENGTH = 63


def check_extended_resource_name(name: str) -> str:
    """The name, or ValueError saying why Kubernetes refuses it as an extended resource name
    (k8s.io/kubernetes pkg/apis/core/helper IsExtendedResourceName): <domain>/<name>, not in the
    kubernetes.io domain (IsNativeResource), not starting with "requests.", and a qualified name
    once "requests." goes before it, as resource quotas name it."""
    if "/" not in name:
        raise ValueError(f"{name[:80]!r} has no domain: an extended resource is named <domain>/<name>, "
                         "such as nvidia.com/gpu-memory")
    if "kubernetes.io/" in name:
        raise ValueError(f"{name[:80]!r} is in the kubernetes.io domain, which is Kubernetes' own")
    if name.startswith("requests."):
        raise ValueError(f"{name[:80]!r} starts with 'requests.', which resource quotas put before names")
    prefix, short = f"requests.{name}".split("/", 1)
    if "/" in short:
        raise ValueError(f"{name[:80]!r} has more than one '/'")
    if not is_dns_subdomain(prefix):
        raise ValueError(f"the domain of {name[:80]!r} is not a lower-case DNS subdomain of at most "
                         f"{_MAX_DNS_SUBDOMAIN_LENGTH - len('requests.')} characters")
    _check_name_part(name, short)
    return name


def _check_name_part(name: str, short: str) -> None:
    """The part of a qualified name after its prefix (IsQualifiedName's name part)."""
    if len(short) > _MAX_QUALIFIED_NAME_LENGTH or not _QUALIFIED_NAME.fullmatch(short):
        raise ValueError(f"the name of {name[:80]!r} is not 1-63 letters, digits, '-', '_' or '.' "
                         "between letters or digits")


def check_qualified_name(name: str) -> str:
    """The name, or ValueError saying why Kubernetes refuses it as a label or annotation key
    (k8s.io/apimachinery pkg/util/validation IsQualifiedName): an optional DNS-subdomain prefix and '/',
    then 1-63 letters, digits, '-', '_' or '.' between letters or digits."""
    prefix, slash, short = name.rpartition("/")
    if slash and ("/" in prefix or not prefix):
        raise ValueError(f"{name[:80]!r} is not a qualified name: at most one '/', after a non-empty prefix")
    if slash and not is_dns_subdomain(prefix):
        raise ValueError(f"the prefix of {name[:80]!r} is not a lower-case DNS subdomain of at most "
                         f"{_MAX_DNS_SUBDOMAIN_LENGTH} characters")
    _check_name_part(name, short)
    return name


_MAX_DNS_LABEL_LENGTH = 63


def check_dns_label(name: str) -> str:
    """The name, or ValueError saying why Kubernetes refuses it as a namespace (IsDNS1123Label)."""
    if len(name) > _MAX_DNS_LABEL_LENGTH or not re.fullmatch(_DNS_LABEL, name):
        raise ValueError(f"{name[:80]!r} is not a DNS label: at most {_MAX_DNS_LABEL_LENGTH} lower-case letters, "
                         "digits and '-', starting and ending with a letter or digit")
    return name
