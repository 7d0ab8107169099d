"""Renders charts/ferrite with the real Helm SDK and prints the manifests as one YAML stream.

Used by the operator's chart test (operator/tests/chart.rs), which applies what this prints
to a real API server:

    python tests/chart/render.py [--values FILE] [--set-json JSON] [--namespace NS] [--name NAME]
"""

import argparse
import json
import sys
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "ferrite"


def render(values: dict | None, name: str, namespace: str) -> list[dict]:
    """The chart's objects (templates only; the CRD lives in crds/), in file order."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=name, namespace=namespace, is_install=True)
    objects = []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(manifests[path]):
            if doc:
                objects.append(doc)
    return objects


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    """The objects grouped by kind, each group in file order."""
    out: dict[str, list[dict]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--values", help="a values file")
    parser.add_argument("--set-json", help="values as JSON, merged over --values")
    parser.add_argument("--name", default="ferrite", help="release name")
    parser.add_argument("--namespace", default="ferrite-system", help="release namespace")
    args = parser.parse_args()
    values: dict = {}
    if args.values:
        values = yaml.safe_load(Path(args.values).read_text()) or {}
    if args.set_json:
        values.update(json.loads(args.set_json))
    yaml.safe_dump_all(render(values, args.name, args.namespace), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
