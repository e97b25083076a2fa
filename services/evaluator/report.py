"""The evaluation report's files: report.json (a services.evaluator.model.Report, the contract other tools read)
and report.html with PNG plots, rendered from the report's JSON form.

report.json keys (REQUIRED are in any report, the others in every report the evaluator writes, live when
measured; the model documents each):
  target, layout, k, per_position_accuracy, acceptance_length, per_position_acceptance, exports   REQUIRED
  answer          first: serve the drafter or not (null: cannot tell), the exact --speculative-config, the predicted
                  gain and where it stops, what to do next (answer() below; the HTML opens with it too)
  live            vLLM A/B: baseline / speculative tok/s, speed-up, τ and per-position acceptance from /metrics
  serve_with      the chat template kwargs (e.g. enable_thinking) the server must render prompts with
  acceptance      τ's counts (drafts, accepted per position), overall and per prompt, and how they were measured
  in_process      real speculative decoding of the first decode_prompts prompts: equality with greedy, counts
  wiring, expected_acceptance_length, drafter, features, prompts, training
  compute         the device the target and drafter ran on, and their dtype
  serving         will it speed up serving (services/evaluator/serving.py): measured step times (target_s, drafter_s,
                  source, step_noise), τ per K (tau_per_k; null where no draft was measured) and the counts it rests
                  on (evidence), predicted tok/s and speed-up with its range within the step times' noise per
                  concurrency and K (table), the best measured K per concurrency (best; pays null: cannot tell),
                  break_even_concurrency, speculative_config (the exact --speculative-config value), decision (one
                  sentence), and live_check (measured vs predicted speed-up) with live_endpoints (the servers it ran
                  against; "started": those the evaluator started and stopped)
"""
from __future__ import annotations

import html
import io
import json
from typing import Any

import matplotlib

from services.evaluator import alternatives
from services.evaluator.costmodel import OFF_BY, plural
from services.evaluator.model import Report

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# the core of any report, hand-written ones included (services.evaluator.model.Report has every key)
REQUIRED = ("target", "layout", "k", "per_position_accuracy", "acceptance_length", "per_position_acceptance",
            "exports")


def expected_per_position(accuracy: list[float], k: int) -> list[float]:
    """Per-position acceptance (vLLM's definition) expected from per-step accuracies: Π_{j≤i} a_j, treating each
    step's teacher-forced accuracy as conditional on the steps before it being right (docs/eagle3.md §6.3)."""
    out, run = [], 1.0
    for a in accuracy[:k]:
        run *= a
        out.append(run)
    return out


def expected_acceptance_length(accuracy: list[float], k: int) -> float:
    """τ ≈ 1 + Σ_{i≤k} Π_{j≤i} a_j."""
    return 1.0 + sum(expected_per_position(accuracy, k))


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
        series["expected from accuracy"] = expected_per_position(report["per_position_accuracy"], k)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, [v or 0.0 for v in values], width=width, label=name)
    ax.set_xticks(range(k), [f"pos {i + 1}" for i in range(k)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("rate")
    tau = report["acceptance_length"]
    ax.set_title(f"per-position acceptance, τ = {_fmt(tau)}" if tau is not None
                 else "per-position acceptance: no drafts measured")
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


def plot_serving(serving: dict[str, Any]) -> bytes:
    """Predicted speed-up vs concurrency, one line per K; the live check's measurements as markers."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    conc = [row["concurrency"] for row in serving["table"]]
    for j, k in enumerate(serving["tau_per_k"]):
        ys = [next(r["speedup"] for r in row["speculative"] if str(r["k"]) == k) for row in serving["table"]]
        ys = [float("nan") if y is None else y for y in ys]  # no drafts measured at this K: no line
        ax.plot(conc, ys, "o-", color=f"C{j}", ms=3, lw=1, label=f"K = {k}")
    for run in serving.get("live_check") or []:
        ax.scatter([run["concurrency"]], [run["measured_speedup"]], marker="x", color="black", zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlim(conc[0] / 1.5, conc[-1] * 1.5)  # set, not from the lines: with no K measured there are none
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speed-up (predicted; × measured)")
    ax.set_title("speculative vs plain decoding, tokens/s")
    ax.legend(fontsize=7, ncol=2)
    return _png(fig)


def plots(report: dict[str, Any], history: dict[str, Any] | None) -> dict[str, bytes]:
    out = {"acceptance.png": plot_acceptance(report)}
    if report.get("serving"):
        out["serving.png"] = plot_serving(report["serving"])
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


def _speedup(point: dict[str, Any]) -> str:
    """"1.08 ×", with its interval under the step times' noise when that is wider than the rounding."""
    low, high = point.get("speedup_range") or (point["speedup"], point["speedup"])
    noise = f" ({low:.2f}–{high:.2f})" if f"{low:.2f}" != f"{high:.2f}" else ""
    return f"{point['speedup']:.2f} ×{noise}"


def break_even_text(serving: dict[str, Any]) -> str:
    """Where speculation stops paying, as a sentence (from the predicted speed-ups; where their range within the
    step times' noise straddles 1, it says that this cannot be told there)."""
    up_to, best = serving["break_even_concurrency"], serving["best"]
    if best[0]["k"] is None:
        return "not known: no drafts were measured"
    if up_to is None:
        text = f"never, at any concurrency predicted (up to {best[-1]['concurrency']})"
    elif up_to == 0:
        text = "from the first request: it loses at every concurrency predicted"
    else:
        text = f"above {plural(up_to, 'concurrent request')}"
    unsure = [str(b["concurrency"]) for b in best if b["k"] is not None and b["pays"] is None]
    if unsure:
        text += f"; within the step times' noise, though, that cannot be told at concurrency {', '.join(unsure)}"
    return text


def _noise_text(noise: list[list[float]] | None) -> str:
    if not noise:
        return "one reading a point, on the serving engine"
    rel = sorted(r for _, r in noise)
    return f"±{rel[len(rel) // 2]:.1%} at the median point, ±{rel[-1]:.1%} at the worst"


def _serving_html(serving: dict[str, Any]) -> list[str]:
    ks = list(serving["tau_per_k"])
    head = "".join(f"<th>K = {html.escape(k)}</th>" for k in ks)
    taus = "".join(f"<td>{t:.3f}</td>" if t is not None else f"<td>no drafts measured at K = {html.escape(k)}</td>"
                   for k, t in serving["tau_per_k"].items())
    rows = "".join(
        f"<tr><th>{row['concurrency']}</th><td>{row['plain_tok_s']:.1f}</td>"
        + "".join(f"<td>{_speedup(r) if r['speedup'] is not None else '—'}</td>" for r in row["speculative"])
        + f"<td>{_best_text(best)}</td></tr>"
        for row, best in zip(serving["table"], serving["best"], strict=True))
    table = (f"<table><tr><th>concurrent requests</th><th>plain tok/s</th>{head}<th>best K</th></tr>"
             f"<tr><th>τ(K)</th><td></td>{taus}<td></td></tr>{rows}</table>")
    noise = serving.get("step_noise") or {}
    summary = [("speculation loses", break_even_text(serving)),
               ("target step times", serving["source"]["target"]),
               ("their noise", _noise_text(noise.get("target"))),
               ("drafter step times", serving["source"]["drafter"]),
               ("their noise", _noise_text(noise.get("drafter")))]
    if serving.get("spec_step_s"):
        summary.append(("speculative step on vLLM", ", ".join(
            f"{t * 1e3:.1f} ms at {plural(b, 'sequence')}" for b, t in serving["spec_step_s"])
            + f"; {serving['spec_tokens_per_step']:.2f} tokens a step"))
    if serving.get("live_error"):
        summary.append(("live check on vLLM", f"not run to the end: {serving['live_error']}"))
    parts = ["<h2>Serving: predicted speed-up per concurrency and K</h2>",
             "<p>Speed-up of speculative over plain decoding in tokens/s, predicted from τ(K) and the step times "
             "below; in brackets, its range within the step times' noise.</p>", table, _table(summary)]
    if serving.get("live_check"):
        live = [(f"concurrency {r['concurrency']}, K = {r['k'] if r['k'] is not None else '(no drafts)'}",
                 _live_text(r)) for r in serving["live_check"]]
        parts += ["<h3>Checked live on vLLM</h3>", _table(live)]
    if serving.get("served"):
        parts += _alternatives_html(serving)
    if serving.get("methods"):
        methods = serving["methods"]
        head = "".join(f"<th>{c['concurrency']}</th>" for c in methods["choice"])
        rows = "".join(f"<tr><th>{html.escape(m['method'])}</th>"
                       + "".join(f"<td>K = {b['k']}: {b['speedup']:.2f} ×</td>" if b["k"] is not None
                                 else "<td>not measured</td>" for b in m["best"]) + "</tr>"
                       for m in methods["methods"])
        pick = "".join(f"<td>{html.escape(c['method'] or 'none measured')}</td>" for c in methods["choice"])
        parts += ["<h3>Methods compared (predicted, best K per concurrency)</h3>",
                  f"<table><tr><th>concurrent requests</th>{head}</tr>{rows}<tr><th>fastest</th>{pick}</tr></table>"]
    return parts


def _alternatives_html(serving: dict[str, Any]) -> list[str]:
    """Plain decoding, the drafter and the free methods, measured on the same prompts and engine."""
    live = {r["concurrency"]: r for r in serving["live_check"]}
    rows = []
    for choice in serving["served"]:
        c, d = choice["concurrency"], live[choice["concurrency"]]
        rows.append(f"<tr><th>{c}</th><td>plain decoding</td><td>{d['baseline_tok_s']:.1f}</td><td>1.00 ×</td>"
                    "<td>—</td><td>—</td></tr>")
        rows.append(f"<tr><th>{c}</th><td>this drafter (K = {_fmt(d['k'])})</td><td>{d['speculative_tok_s']:.1f}</td>"
                    f"<td>{d['measured_end_to_end_speedup']:.2f} ×</td><td>{_fmt(d['tau_vllm'])}</td>"
                    f"<td>{_fmt(d.get('accepted_per_output_token'))}</td></tr>")
        rows += [f"<tr><th>{c}</th><td>{html.escape(alternatives.LABELS.get(r['method'], r['method']))}</td>"
                 f"<td>{r['tok_s']:.1f}</td><td>{r['speedup']:.2f} ×</td><td>{_fmt(r['tau'])}</td>"
                 f"<td>{_fmt(r['accepted_per_output_token'])}</td></tr>"
                 for r in serving["alternatives"] if r["served"] and r["concurrency"] == c]
    missing = [(alternatives.LABELS.get(r["method"], r["method"]), f"not served by this engine: {r['why']}")
               for r in serving["alternatives"] if not r["served"]]
    fastest = [(f"fastest at concurrency {ch['concurrency']}", alternatives.LABELS.get(ch["fastest"], ch["fastest"]))
               for ch in serving["served"]]
    return ["<h3>What to serve: the drafter against what needs no training (measured on vLLM)</h3>",
            "<table><tr><th>concurrent requests</th><th>method</th><th>tok/s</th><th>speed-up</th><th>τ</th>"
            f"<th>accepted per output token</th></tr>{''.join(rows)}</table>",
            _table(fastest + missing + ([("predicted (before measuring)", serving["predicted_decision"])]
                                        if serving.get("predicted_decision") else []))]


def _best_text(best: dict[str, Any]) -> str:
    return f"K = {best['k']}: {_speedup(best)}" if best["k"] is not None else "none measured"


def _live_text(r: dict[str, Any]) -> str:
    predicted = (f"predicted {r['predicted_speedup']:.3f} ×, " if r["predicted_speedup"] is not None
                 else "no prediction (no τ measured in-process at this K), ")
    error = f" ({r['relative_error']:+.1%})" if r["relative_error"] is not None else ""
    off = (f" — the prediction is off by more than {OFF_BY:.0%}: trust the measurement here"
           if r.get("off") else "")
    return (f"{predicted}measured {r['measured_speedup']:.3f} × while decoding{error}, "
            f"{r['measured_end_to_end_speedup']:.3f} × end to end; τ {_fmt(r['tau_in_process'])} in-process, "
            f"{_fmt(r['tau_vllm'])} on vLLM{off}")


def answer(serving: dict[str, Any], prompts: int) -> dict[str, Any]:
    """The report's opening (services.evaluator.model.Answer): serve it or not (null: cannot tell), how (the exact
    --speculative-config), what it gains, and what to do next, from the serving prediction over `prompts` prompts
    and its live check."""
    first = serving["best"][0]
    gains = "; ".join(f"{_speedup(b)} at {plural(b['concurrency'], 'concurrent request')} (K = {b['k']})"
                      for b in serving["best"] if b["k"] is not None) or "not known: no drafts were measured"
    live = serving.get("live_check") or []
    if first["k"] is None:
        step = f"score more prompts or longer answers: {plural(prompts, 'prompt')} gave no draft to check"
    elif first["pays"] is None:
        step = ("measure on the serving engine: install vLLM (scripts/install-vllm.sh; the live check then runs by "
                "default) or give an --endpoint (a vLLM server of the target); in-process times are too noisy to "
                "decide")
    elif not first["pays"]:
        step = ("train on more data or for longer (eyas run --minutes 30): τ rises about 0.04–0.07 for each "
                "doubling of the prompts")
    elif live:
        step = "serve it: measured live " + ", ".join(
            f"{r['measured_speedup']:.2f} × at concurrency {r['concurrency']}" for r in live)
    else:
        step = ("check it live before relying on it: install vLLM (scripts/install-vllm.sh; the live check then runs "
                "by default), or give --endpoint and --spec-endpoint")
    ans = {"decision": serving["decision"], "serve": first["pays"], "speculative_config":
           serving["speculative_config"], "gains": gains, "breaks_even": break_even_text(serving), "next": step}
    return _measured_answer(ans, serving) if serving.get("served") else ans


def _measured_answer(ans: dict[str, Any], serving: dict[str, Any]) -> dict[str, Any]:
    """The answer when the drafter and the free methods were measured on vLLM: what was fastest decides."""
    choice = serving["served"][0]
    best, c = choice["fastest"], choice["concurrency"]
    ans["serve"] = best == "drafter"
    if best == "drafter":
        # serve the K that was measured: the prediction made again from the engine's times may name another one
        measured_k = next((r["k"] for r in serving["live_check"] if r["concurrency"] == c), None)
        config = json.loads(ans["speculative_config"])
        if measured_k is not None and config.get("num_speculative_tokens") != measured_k:
            ans["speculative_config"] = json.dumps({**config, "num_speculative_tokens": measured_k})
        ans["next"] = f"serve it: fastest measured at concurrency {c}"
    elif best == "plain":
        ans["next"] = ("serve the target without speculation for now; train the drafter on more data or for longer "
                       "(eyas run --minutes 30)")
    else:
        config = next(r["config"] for r in serving["alternatives"] if r["method"] == best and r["served"])
        ans["next"] = (f"serve {alternatives.LABELS.get(best, best)} now "
                       f"(--speculative-config '{json.dumps(config)}'), "
                       "and train the drafter on more data (eyas run --minutes 30) until it passes it")
    return ans


def _answer_html(ans: dict[str, Any]) -> list[str]:
    verdict = {True: "Serve it", False: "Do not serve it", None: "Cannot tell yet"}[ans["serve"]]
    flag = "Serve it with" if ans["serve"] else "To try it, serve the target with"
    sentence = ans["decision"][:1].upper() + ans["decision"][1:]
    return [f"<h2>{verdict}</h2>", f"<p class='answer'>{html.escape(sentence)}.</p>",
            f"<p>{flag}</p><pre>--speculative-config '{html.escape(ans['speculative_config'])}'</pre>",
            _table([("predicted speed-up", ans["gains"]), ("speculation loses", ans["breaks_even"]),
                    ("next", ans["next"])])]


def _second_set_text(second: dict[str, Any] | None) -> str:
    if not second:
        return "not run"
    if "skipped" in second:
        return f"{second['source']}: skipped ({second['skipped']})"
    return (f"{_fmt(second['acceptance_length'])} on {plural(second['count'], 'prompt')} of {second['source']} "
            f"(per position {_fmt(second['per_position_acceptance'])})")


def _decoded_text(ip: dict[str, Any]) -> str:
    """Real speculative decoding in-process, as a sentence."""
    n, mismatches = ip.get("prompts") or 0, ip.get("greedy_mismatches") or []
    equal = (f"speculative output equals plain greedy output on {'all ' if n > 1 else ''}{plural(n, 'prompt')}"
             if ip.get("matches_greedy")
             else f"speculative output differs from plain greedy output on {len(mismatches)} of "
                  f"{plural(n, 'prompt')} ({', '.join(mismatches)})")
    counts = ("its drafts and acceptances count exactly as the replay's" if ip.get("replay_matches")
              else "its drafts and acceptances differ from the replay's")
    return f"{equal}; {counts}"


def _evidence_rows(report: dict[str, Any]) -> list[tuple[str, Any]]:
    """The report's evidence table: what was trained and served, and what was measured."""
    ip = report.get("in_process", {})
    scored = report.get("acceptance", {})
    layout = report["layout"]
    drafts = scored.get("drafts")
    return [
        ("target", report["target"]),
        ("drafter", report.get("drafter", "")),
        ("aux layers (trained, physical out(i))", layout["aux_layers"]),
        ("K (draft tokens per step)", report["k"]),
        ("acceptance length τ (replayed over the target's greedy output, incl. bonus)",
         report["acceptance_length"] if report["acceptance_length"] is not None
         else "not measured: no drafts at this K"),
        ("per-position acceptance", report["per_position_acceptance"] if drafts != 0 else "not measured"),
        ("teacher-forced accuracy per TTT step", report["per_position_accuracy"] or "not measured (no features)"),
        ("τ expected from accuracy", report.get("expected_acceptance_length")),
        ("per position: measured / expected from accuracy",
         (report.get("acceptance_gap") or {}).get("ratio") if drafts != 0 else "not measured"),
        ("τ on the second held-out set", _second_set_text(report.get("second_set"))),
        ("τ per category", ", ".join(f"{cat} {_fmt(tau) if tau is not None else 'not measured'}"
                                     for cat, tau in (scored.get("per_category") or {}).items())
         or "the prompts have no categories"),
        ("prompts", f"{plural(scored.get('prompts') or 0, 'prompt')} of "
                    f"{(report.get('prompts') or {}).get('source', 'the prompt file')}, answered in up to "
                    f"{plural(scored.get('max_new_tokens') or 0, 'token')}"),
        ("drafts checked", f"{plural(drafts, 'draft')}, {plural(sum(scored.get('accepted_per_pos') or []), 'token')} "
                           "accepted" if drafts is not None else None),
        ("decoded speculatively in-process", _decoded_text(ip)),
        ("exports", ", ".join(f"{k}: {v}" for k, v in report["exports"].items())),
        ("serve with chat_template_kwargs",
         json.dumps((report.get("serve_with") or {}).get("chat_template_kwargs"))),
    ]


def _live_rows(live: dict[str, Any]) -> list[tuple[str, Any]]:
    """The live A/B table: vLLM serving the target plain and with the drafter."""
    rows: list[tuple[str, Any]] = [("prompts", f"{plural(live['prompts'], 'prompt')}, up to "
                                               f"{plural(live['max_tokens'], 'token')} each"),
                                   ("concurrent requests", live["concurrency"])]
    for name in ("baseline", "speculative"):
        if name in live:
            rows.append((f"{name} tok/s", live[name]["tok_s"]))
    spec = live.get("speculative") or {}
    if spec:
        rows += [("vLLM τ (/metrics)", spec.get("acceptance_length")),
                 ("vLLM per-position acceptance", spec.get("per_position_acceptance")),
                 ("vLLM drafts", f"{plural(spec.get('drafts') or 0, 'draft')}, "
                                 f"{plural(spec.get('accepted') or 0, 'token')} accepted")]
    if "speedup" in live:
        n = plural(live["prompts"], "prompt")
        rows += [("speed-up", live["speedup"]),
                 ("outputs", f"speculative output equals the baseline's on {'all ' if live['prompts'] > 1 else ''}"
                             f"{n}" if live["outputs_equal"]
                  else f"speculative output differs from the baseline's on at least one of {n}")]
    return rows


def render_html(report: dict[str, Any], images: list[str]) -> str:
    wiring = report.get("wiring") or {}
    precision = wiring.get("precision") or {}
    wiring_rows = [("trained on", wiring.get("trained"))] + [
        (f"{name} serves", served) for name, served in (wiring.get("served") or {}).items()] + [
        (f"precision {what}", precision[key]) for what, key in (
            ("captured at", "trained"), ("of this target", "target"), ("warning", "warning")) if precision.get(key)]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Eyas evaluation report</title>",
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}table{border-collapse:collapse;"
        "margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}th{background:#f4f4f4}"
        "pre{background:#f4f4f4;padding:8px;white-space:pre-wrap;word-break:break-all}"
        ".answer{font-size:1.15em}</style>",
        "</head><body><h1>Eyas evaluation report</h1>",
    ]
    if report.get("answer"):
        parts += _answer_html(report["answer"])
    parts += ["<h2>Evidence</h2>", _table(_evidence_rows(report)),
              "<h2>Wiring check (what each engine concatenates)</h2>", _table(wiring_rows)]
    if report.get("live"):
        parts += ["<h2>Live A/B on vLLM</h2>", _table(_live_rows(report["live"]))]
    if report.get("serving"):
        parts += _serving_html(report["serving"])
    parts += ["<h2>Plots</h2>"] + [f"<p><img src='{html.escape(name)}' alt='{html.escape(name)}'></p>"
                                   for name in images]
    parts.append("</body></html>")
    return "\n".join(parts)


def build(report: Report | dict[str, Any], history: dict[str, Any] | None) -> dict[str, bytes]:
    """All report files by name: report.json, report.html and the PNGs it shows; `report` is a Report or its JSON
    form (what report.json holds)."""
    if isinstance(report, Report):
        report = report.model_dump(mode="json")
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise ValueError(f"report lacks required fields {missing}")
    images = plots(report, history)
    files = {"report.json": json.dumps(report, indent=2).encode()}
    files.update(images)
    files["report.html"] = render_html(report, list(images)).encode()
    return files
