"""The Markdown of ``benchmarks.delta_checkpoint``: its tables by scenario and by category of tensor, and its
README line."""

from __future__ import annotations

from typing import Any

from benchmarks._common import fmt_ms, fmt_ratio, md_table, ratio

__all__ = ["TITLE", "readme_summary", "render_markdown"]

TITLE = "Delta checkpoints: bytes and time per checkpoint, full vs XOR+zstd delta"


# ---------------------------------------------------------------------------------------------------- report
def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f} MB"


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "run",
        "trainable / total params",
        "full ckpt",
        "delta ckpt, median [min-max]",
        "full / delta",
        f"mean per write (full every {result['config']['full_every']})",
        "full / mean",
        "zstd alone, no base",
        "write full",
        "write delta",
        "read full",
        "read delta (base + decode)",
    ]
    rows = []
    for sc in result["runs"]:
        s = sc["summary"]
        rows.append(
            [
                sc["name"],
                f"{sc['trainable_params']:,} / {sc['total_params']:,}",
                _mb(s["full_bytes_median"]),
                f"{_mb(s['delta_bytes_median'])} [{_mb(s['delta_bytes_min'])}-{_mb(s['delta_bytes_max'])}]",
                fmt_ratio(s["ratio_full_over_delta"]),
                _mb(s["amortized_bytes_per_write"]),
                fmt_ratio(s["ratio_full_over_amortized"]),
                f"{_mb(s['zstd_only_bytes_median'])} ({fmt_ratio(s['ratio_full_over_zstd_only'])})",
                fmt_ms(s["full_write_s_median"]),
                fmt_ms(s["delta_write_s_median"]),
                fmt_ms(s["read_full_s"]),
                fmt_ms(s["read_delta_s"]),
            ]
        )
    return header, rows


def category_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "part", "raw", "delta (zstd of XOR)", "raw / delta", "zstd alone", "XOR zero bytes (low..high)"]
    rows = []
    for sc in result["runs"]:
        zeros = sc["xor_zero_byte_fraction"]["last_delta"]
        zero_text = "/".join(f"{z:.2f}" for z in zeros) if zeros else "n/a"
        for i, (cat, c) in enumerate(sorted(sc["delta_categories"].items())):
            rows.append(
                [
                    sc["name"] if i == 0 else "",
                    cat,
                    _mb(c["raw"]),
                    _mb(c["delta"]),
                    fmt_ratio(c["raw_over_delta"]),
                    _mb(c["zstd_only"]),
                    zero_text if cat == "weights" else "",
                ]
            )
    return header, rows


def render_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    header, rows = table_rows(result)
    cat_header, cat_rows = category_rows(result)
    adamw = next((r for r in result["runs"] if r["name"] == "adamw"), None)
    lines = [
        f"## {TITLE}",
        "",
        f"`{result['command']}` on {result['date']} ({result['machine']['cpu_model']}, "
        f"{result['machine']['cpu_count']} CPUs, torch {result['machine']['torch']}, zstandard "
        f"{result['zstandard']}). TinyGPT `{cfg['preset']}` preset, {cfg['steps']} steps per run, batch "
        f"{cfg['batch_size']}, a checkpoint every step; the delta tier writes a full shard every {cfg['full_every']} "
        f"writes (zstd level {cfg['level']}, single-threaded). Sizes are whole shards on disk (manifest included); "
        "times are `tier.write` with fsync, medians.",
        "",
        md_table(header, rows),
        "",
        "Delta bytes by part of the state, summed over every delta write (the last column: fraction of zero bytes "
        "in the XOR of the float32 weights with their base, per byte from the lowest mantissa byte to the "
        "sign/exponent byte, at the last delta of the run):",
        "",
        md_table(cat_header, cat_rows),
        "",
    ]
    lossy_rows = []
    for sc in result["runs"]:
        probe = sc.get("lossy_probe_last_delta") or {}
        if probe:
            exact = probe["0"]["tensor_bytes"]
            lossy_rows.append(
                [sc["name"], _mb(exact)]
                + [
                    f"{_mb(probe[k]['tensor_bytes'])} ({fmt_ratio(ratio(exact, probe[k]['tensor_bytes']))} smaller), "
                    f"max rel. error {probe[k]['max_rel_error']:.1e}"
                    for k in ("8", "16")
                ]
            )
    if lossy_rows:
        lines += [
            "Opt-in lossy mode (not the default; breaks bitwise resume), on the last delta of each run: tensor bytes "
            "after zstd and the largest relative error over all float32 values (bound: 2^(k-23)):",
            "",
            md_table(["run", "lossless", "lossy_bits=8", "lossy_bits=16"], lossy_rows),
            "",
        ]
    if adamw is not None:
        s = adamw["summary"]
        lines += [
            f"With dense AdamW every weight and both moments change every step: a delta is "
            f"{fmt_ratio(s['ratio_full_over_delta'])} smaller than a full shard (zstd alone, without a base: "
            f"{fmt_ratio(s['ratio_full_over_zstd_only'])}). The XOR zeroes the sign/exponent byte and part of the "
            "high mantissa byte; the two low mantissa bytes stay random and are what remains. Deltas pay off when "
            "parts of the state stand still (frozen parameters, no optimizer state): see the fine-tuning and SGD rows.",
            "",
        ]
    return "\n".join(lines)


def readme_summary(result: dict[str, Any]) -> str:
    ratios = {run["name"]: run["summary"]["ratio_full_over_delta"] for run in result["runs"]}
    return (
        "**delta checkpoints** (lossless XOR+zstd against full saves of the same state): "
        + ", ".join(f"{name} {value:.2f}x smaller" for name, value in ratios.items())
        + " (dense AdamW changes every weight each step, so a lossless delta saves little)."
    )
