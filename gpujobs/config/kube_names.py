"""Names and values as Kubernetes accepts them, for `cluster=kubernetes` (torch-free, no Kubernetes client).

The regular expressions and length limits are those of Kubernetes' own validation, so a value refused here
is one the API server would refuse at create time (after the job waited for nothing), and one passed here
is one it takes. Sources (kubernetes/kubernetes, `staging/src/k8s.io/apimachinery/pkg/util/validation/
validation.go` unless said otherwise):

- DNS-1123 label: `dns1123LabelFmt = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"`, `DNS1123LabelMaxLength = 63`
  (`IsDNS1123Label`): namespaces (`ValidateNamespaceName`).
- DNS-1123 subdomain: `dns1123SubdomainFmt = dns1123LabelFmt + "(\\." + dns1123LabelFmt + ")*"`,
  `DNS1123SubdomainMaxLength = 253` (`IsDNS1123Subdomain`): service accounts (`ValidateServiceAccountName`),
  priority classes (`pkg/apis/scheduling/validation`: `NameIsDNSSubdomain`), persistent volume claims
  (`ValidatePersistentVolumeName`), Kueue LocalQueues (`kueue pkg/webhooks`: `IsDNS1123Subdomain` of the
  `kueue.x-k8s.io/queue-name` label, which as a label value is also at most 63 characters).
- Qualified name (label keys, extended resource names): an optional DNS-1123 subdomain prefix and `/`, then
  `qualifiedNameFmt = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"`, `qualifiedNameMaxLength = 63`
  (`IsQualifiedName`).
- Label value: `labelValueFmt = "(" + qualifiedNameFmt + ")?"`, `LabelValueMaxLength = 63` (`IsValidLabelValue`).
- Extended resource names (`pkg/apis/core/helper`: `IsExtendedResourceName`): a qualified name with a
  prefix, outside the `kubernetes.io/` namespace (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`).
- Tolerations (`pkg/apis/core/validation`: `ValidateTolerations`): `operator` Exists or Equal (empty:
  Equal), `effect` NoSchedule, PreferNoSchedule or NoExecute (empty: all), a key that is a qualified name
  (empty only with Exists), and no value with Exists.
- Quantities (`staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go`, the grammar in `Quantity`'s
  comment): a signed decimal number and a suffix: binary SI (Ki Mi Gi Ti Pi Ei), decimal SI (n u m "" k M G
  T P E) or a decimal exponent (e3, E-2).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from gpujobs.base.errors import ConfigError

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
#: A DNS-1123 label: lowercase letters, digits and -, alphanumeric at both ends, at most 63 characters.
DNS_LABEL = re.compile(rf"(?=.{{1,63}}\Z){_LABEL}")
DNS_LABEL_TEXT = ("a DNS-1123 label as Kubernetes takes it: lowercase letters, digits and -, starting and ending "
                  "with a letter or digit, at most 63 characters")
#: A DNS-1123 subdomain: DNS-1123 labels joined by dots, at most 253 characters.
DNS_SUBDOMAIN = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*")
DNS_SUBDOMAIN_TEXT = ("a DNS-1123 subdomain as Kubernetes takes it: lowercase letters, digits, - and ., each "
                      "dot-separated part starting and ending with a letter or digit, at most 253 characters")
#: A Kueue LocalQueue name: a DNS-1123 subdomain that also fits a label value (63 characters).
QUEUE_NAME = re.compile(rf"(?=.{{1,63}}\Z){_LABEL}(?:\.{_LABEL})*")
QUEUE_NAME_TEXT = ("a Kueue LocalQueue name: a DNS-1123 subdomain (lowercase letters, digits, - and .) of at most "
                   "63 characters (it is the kueue.x-k8s.io/queue-name label's value)")
_NAME = r"(?=.{1,63}\Z)(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
#: A label value: empty, or a qualified name's name part (at most 63 characters).
LABEL_VALUE = re.compile(rf"(?:{_NAME})?")
LABEL_VALUE_TEXT = ("a label value: empty, or letters, digits, -, _ and . starting and ending with a letter or "
                    "digit, at most 63 characters")
_NAME_PART = re.compile(_NAME)
#: An extended resource name: DOMAIN/NAME, DOMAIN a DNS-1123 subdomain that is not (under) kubernetes.io.
EXTENDED_RESOURCE = re.compile(
    rf"(?!(?:[^/]*\.)?kubernetes\.io/)(?=[^/]{{1,253}}/){_LABEL}(?:\.{_LABEL})*/{_NAME}")
QUALIFIED_NAME_TEXT = ("a label key: [PREFIX/]NAME, PREFIX a DNS-1123 subdomain, NAME letters, digits, -, _ and . "
                       "starting and ending with a letter or digit, at most 63 characters")
EXTENDED_RESOURCE_TEXT = ("an extended resource name: DOMAIN/NAME (e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb), "
                          "DOMAIN a DNS-1123 subdomain outside kubernetes.io, NAME as a label key's")
TOLERATION_KEYS = ("key", "operator", "value", "effect")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
#: A quantity as resource.ParseQuantity reads it: <signedNumber><suffix>.
QUANTITY = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")
QUANTITY_TEXT = "a Kubernetes quantity (a number and a suffix: Ki Mi Gi ..., k M G ..., m)"
#: The same grammar in parts: the number, then a suffix or a decimal exponent.
_QUANTITY_PARTS = re.compile(r"(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
                             r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE](?P<exponent>[+-]?\d+))?")
#: What each suffix multiplies by (quantity.go's `suffixer`: binary SI powers of 2, decimal SI powers of 10).
QUANTITY_SUFFIXES = {
    **{binary: Decimal(2) ** (10 * power) for power, binary in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)},
    **{decimal: Decimal(10) ** power for decimal, power in
       (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


def is_qualified_name(text: str, *, prefixed: bool = False) -> bool:
    """A label key (`IsQualifiedName`): `[PREFIX/]NAME`; `prefixed`: the prefix is required."""
    prefix, slash, name = text.rpartition("/")
    if slash and not DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return bool(_NAME_PART.fullmatch(name)) and (bool(slash) or not prefixed)


def check_node_selector(key: str, selector: dict[str, Any]) -> None:
    """Each entry a label key and a label value; ConfigError naming `key.LABEL`."""
    for label, value in selector.items():
        if not is_qualified_name(str(label)):
            raise ConfigError(key, label, QUALIFIED_NAME_TEXT)
        if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            raise ConfigError(f"{key}.{label}", value, LABEL_VALUE_TEXT)


def check_toleration(key: str, toleration: dict[str, Any]) -> None:
    """One toleration as `ValidateTolerations` takes it; ConfigError naming `key.FIELD`."""
    for name in toleration:
        if name not in TOLERATION_KEYS:
            raise ConfigError(f"{key}.{name}", toleration[name], f"the keys {', '.join(TOLERATION_KEYS)}")
    label, value = toleration.get("key", ""), toleration.get("value", "")
    operator, effect = toleration.get("operator", "Equal"), toleration.get("effect", "")
    if operator not in TOLERATION_OPERATORS:
        raise ConfigError(f"{key}.operator", operator, f"one of {', '.join(TOLERATION_OPERATORS)}")
    if effect and effect not in TOLERATION_EFFECTS:
        raise ConfigError(f"{key}.effect", effect, f"one of {', '.join(TOLERATION_EFFECTS)}, or empty (all effects)")
    if label and not is_qualified_name(str(label)):
        raise ConfigError(f"{key}.key", label, QUALIFIED_NAME_TEXT)
    if not label and operator != "Exists":
        raise ConfigError(f"{key}.key", label, "a label key (empty only with operator Exists: every taint)")
    if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
        raise ConfigError(f"{key}.value", value, LABEL_VALUE_TEXT)
    if value and operator == "Exists":
        raise ConfigError(f"{key}.value", value, "empty with operator Exists (it matches any value)")


def quantity(key: str, text: str) -> str:
    """`text` if Kubernetes parses it as a quantity, else ConfigError naming `key`."""
    if not QUANTITY.fullmatch(text):
        raise ConfigError(key, text, QUANTITY_TEXT)
    return text


def quantity_value(key: str, value: object) -> Decimal:
    """The exact number a quantity stands for, as resource.ParseQuantity reads it: `value` is its text or, as
    the API may send a quantity (`x-kubernetes-int-or-string`), an int; ConfigError naming `key` otherwise."""
    parts = _QUANTITY_PARTS.fullmatch(str(value)) if isinstance(value, (str, int)) else None
    if parts is None or isinstance(value, bool):
        raise ConfigError(key, value, QUANTITY_TEXT)
    number = Decimal(parts["number"])
    if parts["exponent"] is not None:
        return number.scaleb(int(parts["exponent"]))
    return number * QUANTITY_SUFFIXES[parts["suffix"]] if parts["suffix"] else number
