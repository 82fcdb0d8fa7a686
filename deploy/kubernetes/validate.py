"""Validates rendered manifests offline: every object of a kind Kubernetes defines against
its schema (kubernetes-validate, strict: unknown fields fail), and the custom resources tern
uses (KEDA's ScaledObject and TriggerAuthentication, the Prometheus Operator's
ServiceMonitor) against models generated from their CRDs (cloudcoil), unknown fields failing
there too. Any other kind fails.

Usage: validate.py KUBERNETES_VERSION FILE...   (e.g. 1.31.0 rendered.yaml)
Prints one line per object; exits 1 if any fails.
"""

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


def main():
    version, files = sys.argv[1], sys.argv[2:]
    failed = 0
    for name in files:
        with open(name) as f:
            for doc in yaml.safe_load_all(f):
                if not doc:
                    continue
                what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
                error = check(doc, version)
                print(f"{name}: {what}: {'ok' if error is None else 'INVALID: ' + error}")
                failed += error is not None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
