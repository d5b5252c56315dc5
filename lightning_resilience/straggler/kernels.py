"""CUPTI kernel scores from nvidia-resiliency-ext (NVRx) as an optional extra series, GPU only.

NVRx's ``straggler.Detector`` times every CUDA kernel launched inside a section with CUPTI and scores a rank by the
reference median kernel time over its own (weighted over kernels, NCCL kernels excluded). We run it per rank
(``gather_on_rank0=False``), take the rank's *relative* GPU score (reference: the fastest rank, an all-reduce NVRx
does on the default process group) and turn it into a slowdown factor ``1 / score`` that travels with our own
timings. Nothing here is required: on CPU, or where CUPTI cannot load, :func:`open_kernel_scores` returns None.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

__all__ = ["KERNELS", "NvrxKernelScores", "open_kernel_scores"]

log = logging.getLogger(__name__)

KERNELS = "kernels"
"""Name of the kernel-score series."""


class NvrxKernelScores:
    """Wraps ``nvidia_resiliency_ext.straggler.Detector`` (a class-level singleton: one instance per process)."""

    def __init__(self, profiling_interval: int = 1) -> None:
        from nvidia_resiliency_ext.straggler import Detector

        self._detector: Any = Detector
        Detector.initialize(
            scores_to_compute="all",
            gather_on_rank0=False,
            profiling_interval=profiling_interval,
            report_time_interval=float("inf"),  # we decide when to report, at our gather cadence
        )
        self._section: Any = None

    def begin(self) -> None:
        if self._section is None:
            self._section = self._detector.detection_section(KERNELS, profile_cuda=True)
            self._section.__enter__()

    def end(self) -> None:
        if self._section is not None:
            section, self._section = self._section, None
            section.__exit__(None, None, None)

    def slowdown(self) -> float:
        """This rank's kernel slowdown against the fastest rank since the last call (NaN without kernels).

        Collective: every rank calls it at the same step (NVRx all-reduces the kernel medians)."""
        report = self._detector.generate_report()
        scores = report.gpu_relative_perf_scores if report is not None else {}
        score = next(iter(scores.values()), float("nan")) if scores else float("nan")
        return 1.0 / score if math.isfinite(score) and score > 0 else float("nan")

    def close(self) -> None:
        self.end()
        if self._detector.initialized:
            self._detector.shutdown()


def open_kernel_scores(profiling_interval: int = 1) -> NvrxKernelScores | None:
    """NVRx kernel scores if a GPU and CUPTI are usable here, else None (with a warning naming the reason)."""
    if not torch.cuda.is_available():
        log.warning("straggler.kernel_scores needs a CUDA device: kernel scores are off")
        return None
    try:
        return NvrxKernelScores(profiling_interval)
    except (ImportError, OSError, RuntimeError) as err:
        log.warning("straggler.kernel_scores: NVRx CUPTI profiling is unavailable (%s): kernel scores are off", err)
        return None
