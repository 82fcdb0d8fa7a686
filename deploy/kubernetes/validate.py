"""Validates rendered manifests offline: every object of a kind Kubernetes defines against
its schema (kubernetes-validate, strict: unknown fields fail), and the custom resources tern
uses (KEDA's ScaledObject and TriggerAuthentication, the Prometheus Operator's
ServiceMonitor) against models generated from their CRDs (cloudcoil), unknown fields failing
there too. Any other kind fails. Then each worker pool against its ScaledObject: every job kind
the pool's TERN_WORKER_KINDS names has a trigger counting it, and every trigger counts a kind the
pool serves (a pool would otherwise never wake for its work, or wake for work it cannot take).

Usage: validate.py KUBERNETES_VERSION FILE...   (e.g. 1.31.0 rendered.yaml)
Prints one line per object; exits 1 if any fails.
"""

import re
import sys

import kubernetes_validate
import pydantic
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TriggerAuthentication,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
}


def unknown_fields(given, known, path=""):
    """Paths in `given` that the model's own rendering of it (`known`) lacks."""
    if isinstance(given, dict):
        if not isinstance(known, dict):
            return [path or "/"]
        out = []
        for key, value in given.items():
            if key not in known:
                out.append(f"{path}/{key}")
            else:
                out.extend(unknown_fields(value, known[key], f"{path}/{key}"))
        return out
    if isinstance(given, list) and isinstance(known, list):
        return [p for i, (g, k) in enumerate(zip(given, known)) for p in unknown_fields(g, k, f"{path}/{i}")]
    return []


def check(doc, version):
    """None when `doc` is valid, else why not."""
    model = CUSTOM.get((doc.get("apiVersion"), doc.get("kind")))
    if model is not None:
        try:
            parsed = model.model_validate(doc, strict=True)
        except pydantic.ValidationError as e:
            return str(e)
        extra = unknown_fields(doc, parsed.model_dump(by_alias=True, exclude_none=True, mode="json"))
        return f"unknown fields {extra}" if extra else None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return f"no schema for {doc.get('apiVersion')} {doc.get('kind')}: not a kind this check knows"
    except kubernetes_validate.ValidationError as e:
        return f"{'/'.join(str(p) for p in e.path)}: {e.message}"
    return None


KIND_IN_QUERY = re.compile(r"kind\s*(?:=\s*'(\w+)'|IN\s*\(([^)]*)\))", re.IGNORECASE)


def pool_kinds(deployment):
    """The job kinds a worker Deployment's TERN_WORKER_KINDS names, or None (not a worker)."""
    for container in deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        for env in container.get("env", []):
            if env.get("name") == "TERN_WORKER_KINDS":
                return set(k.strip() for k in env.get("value", "").split(",") if k.strip())
    return None


def trigger_kinds(scaled_object):
    """The job kinds the postgresql triggers of a ScaledObject count."""
    kinds = set()
    for trigger in scaled_object.get("spec", {}).get("triggers", []):
        for one, many in KIND_IN_QUERY.findall(trigger.get("metadata", {}).get("query", "")):
            kinds |= {one} if one else set(re.findall(r"'(\w+)'", many))
    return kinds


def check_pools(docs):
    """(what, error or None) for each worker pool of one rendered file."""
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d.get("kind") == "ScaledObject" and "scaleTargetRef" in d.get("spec", {})}
    for d in docs:
        if d.get("kind") != "Deployment":
            continue
        kinds = pool_kinds(d)
        if kinds is None:
            continue
        name = d["metadata"]["name"]
        what = f"pool {name} ({','.join(sorted(kinds))})"
        if name not in scaled:
            yield what, "no ScaledObject scales it"
            continue
        counted = trigger_kinds(scaled[name])
        unscaled, foreign = kinds - counted, counted - kinds
        if unscaled or foreign:
            yield what, f"kinds served but never counted by a trigger: {sorted(unscaled)}; counted but not served: {sorted(foreign)}"
        else:
            yield what, None


def main():
    version, files = sys.argv[1], sys.argv[2:]
    failed = 0
    for name in files:
        with open(name) as f:
            docs = [doc for doc in yaml.safe_load_all(f) if doc]
        for doc in docs:
            what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            error = check(doc, version)
            print(f"{name}: {what}: {'ok' if error is None else 'INVALID: ' + error}")
            failed += error is not None
        for what, error in check_pools(docs):
            print(f"{name}: {what}: {'ok' if error is None else 'INVALID: ' + error}")
            failed += error is not None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
