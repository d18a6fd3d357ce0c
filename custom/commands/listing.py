"""``feduq methods`` and ``feduq tasks``: what this installation has registered, as a table (or JSON)."""

from __future__ import annotations

import json

from ..cli import verb_parser


def method_rows() -> list[dict]:
    """One row per registered method: name, kind, task, the paper's line, and per FLARE task what its ledger lets
    leave a site (``model``: the model tensors; then extra tensors, metrics and meta keys by name)."""
    from ..registry import all_methods, spec_of

    rows = []
    for name in all_methods():
        spec = spec_of(name)
        leaves = {task: (["model"] if d["model"] else []) + sorted(d["extra_model"]) + sorted(d["metrics"])
                  + sorted(d["meta"]) for task, d in spec.ledger.items()}
        rows.append({"method": name, "kind": spec.kind, "task": spec.task, "description": spec.description,
                     "leaves_site": leaves})
    return rows


def task_rows() -> list[dict]:
    """One row per built-in task: name, sites, input channels, structures (class names)."""
    from ..tasks.spec import TASKS

    return [{"task": name, "sites": list(t.centers), "in_channels": t.in_channels, "classes": list(t.class_names)}
            for name, t in TASKS.items()]


def verb_main(verb: str, argv=None) -> int:
    """``feduq methods`` / ``feduq tasks`` (``--json`` for a machine-readable list)."""
    p = verb_parser(f"feduq {verb}", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    a = p.parse_args(argv)
    rows = method_rows() if verb == "methods" else task_rows()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        if verb == "methods":
            print(f"{r['method']:<12} {r['kind']:<3} {r['task']:<8} {r['description']}")
            for task, keys in r["leaves_site"].items():
                print(f"{'':<14}{task} sends: {', '.join(keys) or 'nothing'}")
        else:
            print(f"{r['task']:<9} {r['in_channels']} channel(s); classes {', '.join(r['classes'])}; "
                  f"sites {', '.join(r['sites'])}")
    return 0
