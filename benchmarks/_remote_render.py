"""The Markdown and the console table of ``benchmarks.remote_tier``, and its README line."""

from __future__ import annotations

from typing import Any

from benchmarks._common import fmt_ms, md_table, print_flush, ratio

__all__ = ["TITLE", "print_table", "readme_summary", "render_markdown"]

TITLE = "Remote tier: restore from RAM / local disk / S3, and upload throughput vs the raw link"


# ---------------------------------------------------------------------------------------------------- report
def _mbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.0f} MB/s"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.1f} MB"


def _x(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def _range(entry: dict[str, Any]) -> str:
    return f"{fmt_ms(entry['median_s'])} [{fmt_ms(entry['min_s'])}-{fmt_ms(entry['max_s'])}]"


def render_markdown(result: dict[str, Any]) -> str:
    cfg, m, rs, wr, r = result["config"], result["machine"], result["restore"], result["write"], result["ratios"]
    shard = wr["remote_tier_write"]["bytes"]
    restore_rows = [
        [
            "RAM (`MemoryTier`, buffers handed over)",
            _range(rs["memory"]),
            "1x",
            "no copy",
        ],
        [
            "local disk (`LocalTier`, fresh manager, page cache warm)",
            _range(rs["local"]),
            _x(r["restore_local_over_memory"]),
            _mbps(ratio(shard, rs["local"]["median_s"])),
        ],
        [
            "local disk, page cache dropped (fadvise)",
            _range(rs["local_cold"]),
            _x(ratio(rs["local_cold"]["median_s"], rs["memory"]["median_s"])),
            _mbps(ratio(shard, rs["local_cold"]["median_s"])),
        ],
        [
            "S3 on loopback (`RemoteTier`, fresh manager)",
            _range(rs["remote"]),
            _x(r["restore_remote_over_memory"]),
            _mbps(ratio(shard, rs["remote"]["median_s"])),
        ],
    ]
    write_rows = [
        [
            label,
            _mb(wr[key]["bytes"]),
            _range(wr[key]["time"]),
            _mbps(wr[key]["throughput_Bps"]),
            _x(ratio(wr[key]["throughput_Bps"], wr["raw_s3fs_put"]["throughput_Bps"])),
        ]
        for label, key in (
            ("`LocalTier.write` (stage, fsync, rename)", "local_tier_write"),
            ("`RemoteTier.write` (stage, upload, manifest last)", "remote_tier_write"),
            ("raw s3fs `put`, one file of the same size", "raw_s3fs_put"),
            ("raw s3fs `get` of that file (download, for context)", "raw_s3fs_get"),
        )
    ]
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            f"`{result['command']}` on {result['date']} ({m['cpu_model']}, {m['cpu_count']} CPUs, torch "
            f"{m['torch']}, moto {result['versions']['moto']}, s3fs {result['versions']['s3fs']}). TinyGPT "
            f"`{cfg['preset']}` ({cfg['params']:,} parameters) after {cfg['train_steps']} AdamW step(s): "
            f"{_mb(wr['tensor_bytes'])} of tensors, a {_mb(shard)} shard. S3 is moto's `ThreadedMotoServer` on "
            "127.0.0.1 in the benchmark's own process (it shares the GIL and the cores with the client): not a "
            f"network, so read the ratios, not the MB/s. Medians of {cfg['reps']} repetitions [min-max] after one "
            "untimed warm-up, the paths interleaved round-robin in a rotating order; every restored state was checked "
            "bit for bit.",
            "",
            "Restore of the same step through `CheckpointManager.restore` (listing, agreement, load, verify "
            "checksums, rebuild the state). The time to apply it (`load_state_dict` into the live model and "
            "optimizer) is not included: it is the same for every source and dominates a RAM restore, so the "
            '"vs RAM" column overstates what a user gains; the checkpoint section above measures restore + apply:',
            "",
            md_table(["from", "restore time", "vs RAM (read only)", "shard bytes / time"], restore_rows),
            "",
            "Writes of that state (throughput = shard bytes / median time; the last column compares with the raw "
            "upload over the same link):",
            "",
            md_table(["path", "bytes", "time", "throughput", "vs raw put"], write_rows),
            "",
            f"`RemoteTier.write` reaches **{_x(r['upload_ours_over_raw'])}** of the link's raw upload "
            "bandwidth (ours / raw, the same server in the same run). What it adds, one after the other: staging the "
            "shard in a local temporary directory (serialise, checksum, fsync), a listing that clears any earlier "
            "copy of the step, and the manifest as a separate last PUT; its median time is "
            f"{_x(r['remote_write_over_local_write_plus_raw_put'])} the sum of a `LocalTier.write` and a raw put. "
            f"A restore from S3 takes {_x(r['restore_remote_over_local'])} the time "
            f"of one from warm local disk and {_x(r['restore_remote_over_memory'])} that of one from RAM (reads only); "
            f"against a raw `get` of the same bytes it is {_x(r['restore_remote_over_raw_get'])}.",
            "",
        ]
    )


def print_table(result: dict[str, Any]) -> None:
    rs, wr = result["restore"], result["write"]
    print_flush("")
    print_flush(f"{'restore from':<28}{'median':>12}{'min':>12}{'max':>12}")
    for key in ("memory", "local", "local_cold", "remote"):
        e = rs[key]
        print_flush(f"{key:<28}{fmt_ms(e['median_s']):>12}{fmt_ms(e['min_s']):>12}{fmt_ms(e['max_s']):>12}")
    print_flush("")
    print_flush(f"{'write':<28}{'bytes':>12}{'median':>12}{'throughput':>14}")
    for key in ("local_tier_write", "remote_tier_write", "raw_s3fs_put", "raw_s3fs_get"):
        e = wr[key]
        print_flush(
            f"{key:<28}{_mb(e['bytes']):>12}{fmt_ms(e['time']['median_s']):>12}{_mbps(e['throughput_Bps']):>14}"
        )
    print_flush("")
    for key, value in result["ratios"].items():
        print_flush(f"{key:<44}{_x(value):>10}")


def readme_summary(result: dict[str, Any]) -> str:
    r = result["ratios"]
    return (
        f"**remote tier** (S3 API, local server): uploads at {r['upload_ours_over_raw'] * 100:.0f}% of the raw "
        f"link's throughput; a restore from S3 takes {r['restore_remote_over_raw_get']:.2f}x a raw GET of the same "
        f"bytes and {r['restore_remote_over_local']:.1f}x a local-disk restore."
    )
