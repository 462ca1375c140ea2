"""The ValidatingAdmissionPolicies of manifests/base/launched-pods-policy.yaml, evaluated with
cel-python on an admission request as the API server builds it: `object`, `oldObject` and
`request` (user, resource, subresource, operation, namespace), the match conditions first, then
the variables in order (each may read the ones before it), then every validation.

Limitations: cel-python is not Kubernetes' CEL: no type checking against the OpenAPI schema, no
cost limits; a policy that passes here is checked again by the API server when it is applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "manifests" / "base" / "launched-pods-policy.yaml"
NS = "moerl"
LAUNCHER = f"system:serviceaccount:{NS}:moerl-launcher"
RUN_ACCOUNT = f"system:serviceaccount:{NS}:moerl-pipeline"


def policies(path: Path = POLICIES) -> dict[str, dict]:
    """Name -> ValidatingAdmissionPolicy."""
    return {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all(path.read_text())
        if d and d["kind"] == "ValidatingAdmissionPolicy"
    }


def refused(
    policy: dict,
    obj: dict | None,
    resource: str,
    user: str = LAUNCHER,
    *,
    operation: str = "CREATE",
    old: dict | None = None,
    sub: str = "",
    namespace: str = NS,
) -> list[str] | None:
    """The messages of `policy`'s failed validations for `operation` on `obj` (a `resource`,
    `sub` its subresource; `old`: the object a DELETE or UPDATE replaces) by `user`; None: the
    policy does not match the request."""
    import celpy
    from celpy import celtypes

    env, spec = celpy.Environment(), policy["spec"]

    def ev(expr: str, act: dict[str, Any]):
        return env.program(env.compile(expr)).evaluate(act)

    rules = spec["matchConstraints"]["resourceRules"]
    want = f"{resource}/{sub}" if sub else resource
    if not any(want in r["resources"] and operation in r["operations"] for r in rules):
        return None
    act: dict[str, Any] = {
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(
            {
                "userInfo": {"username": user},
                "resource": {"resource": resource},
                "subResource": sub,
                "operation": operation,
                "namespace": namespace,
            }
        ),
    }
    if not all(ev(m["expression"], act) for m in spec.get("matchConditions", [])):
        return None
    variables: dict = {}
    for v in spec.get("variables", []):
        act["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(v["name"])] = ev(v["expression"], act)
    act["variables"] = celtypes.MapType(variables)
    return [v["message"] for v in spec["validations"] if not ev(v["expression"], act)]
