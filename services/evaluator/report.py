"""The evaluation report: report.json (the contract other tools read) and report.html with PNG plots.

report.json keys (REQUIRED are always present; the others when measured):
  target, layout, k, per_position_accuracy, acceptance_length, per_position_acceptance, exports   REQUIRED
  live            vLLM A/B: baseline / speculative tok/s, speed-up, τ and per-position acceptance from /metrics
  wiring, in_process, expected_acceptance_length, drafter, features, prompts, training
"""
from __future__ import annotations

import html
import io
import json
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REQUIRED = ("target", "layout", "k", "per_position_accuracy", "acceptance_length", "per_position_acceptance",
            "exports")


def expected_acceptance_length(accuracy: list[float], k: int) -> float:
    """τ ≈ 1 + Σ_{i<k} Π_{j≤i} a_j from per-step accuracies (spec §6.3), treating each as conditional."""
    tau, run = 1.0, 1.0
    for a in accuracy[:k]:
        run *= a
        tau += run
    return tau


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plot_acceptance(report: dict[str, Any]) -> bytes:
    k = report["k"]
    series = {"in-process acceptance": report["per_position_acceptance"]}
    spec = (report.get("live") or {}).get("speculative")
    if spec and spec.get("per_position_acceptance"):
        series["vLLM acceptance (/metrics)"] = spec["per_position_acceptance"]
    if report["per_position_accuracy"]:
        series["teacher-forced accuracy"] = report["per_position_accuracy"][:k]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, [v or 0.0 for v in values], width=width, label=name)
    ax.set_xticks(range(k), [f"pos {i + 1}" for i in range(k)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("rate")
    ax.set_title(f"per-position acceptance, τ = {_fmt(report['acceptance_length'])}")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_loss(history: dict[str, Any]) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = history.get("train") or []
    val = history.get("val") or []
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_accuracy(history: dict[str, Any], final: list[float]) -> bytes:
    """Accuracy per TTT step over training (training records as lines, validation as markers), and the
    evaluator's final values on the validation split."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train, val = history.get("train") or [], history.get("val") or []
    steps = max((len(r["acc"]) for r in train + val), default=0)
    for k in range(steps):
        color = f"C{k}"
        pts = [(r["step"], r["acc"][k]) for r in train if len(r["acc"]) > k]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, lw=1, alpha=0.6,
                    label=f"train, TTT step {k}")
        pts = [(r["step"], r["acc"][k]) for r in val if len(r["acc"]) > k]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--", color=color, ms=4,
                    label=f"validation, TTT step {k}")
    if final:
        last = max((r["step"] for r in train + val), default=0)
        ax.scatter([last] * len(final), final, marker="x", color="black", zorder=3, label="evaluator (validation)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_title("teacher-forced accuracy per TTT step")
    ax.legend(fontsize=7)
    return _png(fig)


def plots(report: dict[str, Any], history: dict[str, Any] | None) -> dict[str, bytes]:
    out = {"acceptance.png": plot_acceptance(report)}
    if history:
        out["loss.png"] = plot_loss(history)
    out["accuracy.png"] = plot_accuracy(history or {}, report["per_position_accuracy"])
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def render_html(report: dict[str, Any], images: list[str]) -> str:
    ip = report.get("in_process", {})
    layout = report["layout"]
    summary = [
        ("target", report["target"]),
        ("drafter", report.get("drafter", "")),
        ("aux layers (trained, physical out(i))", layout["aux_layers"]),
        ("K (draft tokens per step)", report["k"]),
        ("acceptance length τ (in-process, incl. bonus)", report["acceptance_length"]),
        ("per-position acceptance", report["per_position_acceptance"]),
        ("teacher-forced accuracy per TTT step", report["per_position_accuracy"]),
        ("τ expected from accuracy", report.get("expected_acceptance_length")),
        ("prompts", f"{ip.get('prompts')} × ≤{ip.get('max_new_tokens')} tokens "
                    f"({(report.get('prompts') or {}).get('source', '')})"),
        ("drafts / accepted", f"{ip.get('drafts')} / {ip.get('accepted')}"),
        ("output equals plain greedy", f"{ip.get('matches_greedy')} (mismatches: {ip.get('greedy_mismatches')})"),
        ("exports", ", ".join(f"{k}: {v}" for k, v in report["exports"].items())),
    ]
    wiring = report.get("wiring") or {}
    wiring_rows = [("trained on", wiring.get("trained"))] + [
        (f"{name} serves", served) for name, served in (wiring.get("served") or {}).items()]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Eyas evaluation report</title>",
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}table{border-collapse:collapse;"
        "margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}th{background:#f4f4f4}</style>",
        "</head><body><h1>Eyas evaluation report</h1>",
        "<h2>Summary</h2>", _table(summary),
        "<h2>Wiring check (what each engine concatenates)</h2>", _table(wiring_rows),
    ]
    live = report.get("live")
    if live:
        rows: list[tuple[str, Any]] = [("prompts × max tokens", f"{live['prompts']} × {live['max_tokens']}"),
                                       ("concurrency", live["concurrency"])]
        for name in ("baseline", "speculative"):
            if name in live:
                rows.append((f"{name} tok/s", live[name]["tok_s"]))
        spec = live.get("speculative") or {}
        if spec:
            rows += [("vLLM τ (/metrics)", spec.get("acceptance_length")),
                     ("vLLM per-position acceptance", spec.get("per_position_acceptance")),
                     ("vLLM drafts / accepted", f"{spec.get('drafts')} / {spec.get('accepted')}")]
        if "speedup" in live:
            rows += [("speed-up", live["speedup"]), ("outputs equal", live["outputs_equal"])]
        parts += ["<h2>Live A/B on vLLM</h2>", _table(rows)]
    parts += ["<h2>Plots</h2>"] + [f"<p><img src='{html.escape(name)}' alt='{html.escape(name)}'></p>"
                                   for name in images]
    parts.append("</body></html>")
    return "\n".join(parts)


def build(report: dict[str, Any], history: dict[str, Any] | None) -> dict[str, bytes]:
    """All report files by name: report.json, report.html and the PNGs it shows."""
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise ValueError(f"report lacks required fields {missing}")
    images = plots(report, history)
    files = {"report.json": json.dumps(report, indent=2).encode()}
    files.update(images)
    files["report.html"] = render_html(report, list(images)).encode()
    return files
