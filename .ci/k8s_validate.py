"""Offline validation of what rollfleet ships for Kubernetes, with Kubernetes' own schemas.

- every object of manifests/operator/*.yaml against the OpenAPI schemas of the Kubernetes API
  (PyPI's `kubernetes-validate`, which ships them in its wheel), strictly (an unknown field fails);
- every example RLJob (each YAML file under examples/ whose kind is RLJob) against the
  openAPIV3Schema of the generated CRD (manifests/operator/crd.yaml);
- a malformed RLJob against the same schema: it must be refused, naming the field path;
- the objects the operator creates for each example RLJob (`rollfleet-operator desired`: the
  ConfigMap, the scheduler's Service and every Deployment, their probes and security contexts
  included) against the Kubernetes API's schemas, strictly, when the operator's binary is
  built ($ROLLFLEET_OPERATOR_BIN, default target/debug/rollfleet-operator; without it this
  part fails unless K8S_VALIDATE_WITHOUT_OPERATOR=1).

Run by .ci/k8s-validate, which installs kubernetes-validate into a virtual environment first.
Exits non-zero on any failure.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The API the operator is built against (k8s-openapi's `v1_33`), and the newest the wheel knows.
VERSIONS = ["1.33.0", kubernetes_validate.latest_version()]


class Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `1.54e9` (no sign in the exponent) is a string; kubectl's
    YAML reader (go-yaml) and the rollfleet binary read it as a number, as YAML 1.2 does. This
    loader reads numbers as they do, so the schemas see what the API server would."""


Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d]


def path_of(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(the object)"


def main() -> int:
    failures: list[str] = []
    checked = 0
    manifests = sorted((ROOT / "manifests" / "operator").glob("*.yaml"))
    if not manifests:
        failures.append("no manifests under manifests/operator")
    for path in manifests:
        for doc in documents(path):
            name = f"{path.relative_to(ROOT)}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            for version in VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                    checked += 1
                except kubernetes_validate.ValidationError as e:
                    failures.append(f"{name} (Kubernetes {version}): {path_of(e)}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    failures.append(f"{name} (Kubernetes {version}): no schema: {e}")

    crd = documents(ROOT / "manifests" / "operator" / "crd.yaml")[0]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    validator = jsonschema.Draft7Validator(schema)
    jobs = []
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for doc in documents(path):
            if isinstance(doc, dict) and doc.get("kind") == "RLJob":
                jobs.append((path, doc))
    if len(jobs) < 5:
        failures.append(f"only {len(jobs)} example RLJobs found under examples/")
    for path, doc in jobs:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        for e in errors:
            failures.append(f"{path.relative_to(ROOT)}: {path_of(e)}: {e.message}")
        checked += 1

    # A malformed RLJob: refused by the CRD's schema, at the field that is wrong.
    quickstart = next(doc for path, doc in jobs if path.name == "quickstart.yaml")
    malformed = copy.deepcopy(quickstart)
    malformed["spec"]["pools"][1]["count"] = "many"
    paths = [path_of(e) for e in validator.iter_errors(malformed)]
    if "spec.pools[1].count" not in paths:
        failures.append(f"a pool count of 'many' was not refused at spec.pools[1].count: {paths}")
    checked += 1

    # What the operator creates, from its own code.
    operator = pathlib.Path(os.environ.get("ROLLFLEET_OPERATOR_BIN", ROOT / "target/debug/rollfleet-operator"))
    if operator.is_file():
        created = 0
        for path, doc in jobs:
            out = subprocess.run(
                [str(operator), "desired", str(path)], capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                failures.append(f"rollfleet-operator desired {path.relative_to(ROOT)}: {out.stderr.strip()}")
                continue
            for obj in yaml.load_all(out.stdout, Loader=Loader):
                name = f"{path.relative_to(ROOT)} -> {obj.get('kind')}/{obj['metadata']['name']}"
                for version in VERSIONS:
                    try:
                        kubernetes_validate.validate(obj, version, strict=True)
                        checked += 1
                    except kubernetes_validate.ValidationError as e:
                        failures.append(f"{name} (Kubernetes {version}): {path_of(e)}: {e.message}")
                created += 1
        print(f"{created} objects the operator creates for {len(jobs)} example RLJobs")
        if created < 3 * len(jobs):
            failures.append(f"only {created} objects created for {len(jobs)} RLJobs")
    elif os.environ.get("K8S_VALIDATE_WITHOUT_OPERATOR") != "1":
        failures.append(f"no operator binary at {operator} (cargo build -p rollfleet-operator)")

    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    print(f"{checked} checks, {len(failures)} failures (Kubernetes {', '.join(VERSIONS)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
