"""``deploykit.load``: predictions equal a direct ONNX Runtime run, for every input kind, routed
by the documented resolution rule, batched without changing any answer."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import PIL.Image as PIL
import pytest
from serve_reference import ort_logits, preprocessed, softmax_top_k
from stand_in_runner import NanRowRunner

import deploykit
from deploykit.errors import ConfigError, DeployKitError, InputError, MissingDependencyError
from deploykit.inputs.builtin import sample_images
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.serve import Pipeline, nearest_resolution
from tests import image_bombs


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    astronaut, chelsea, coffee = sample_images(3)
    return [
        astronaut,  # 512x512 -> 48
        chelsea,  # 300x451 -> 48
        np.ascontiguousarray(astronaut[:32, :32]),  # exactly 32x32 -> 32
        np.ascontiguousarray(chelsea[100:133, 50:80]),  # 33x30 -> 32 (nearest)
        np.ascontiguousarray(coffee[:48, :48]),  # exactly 48x48 -> 48
        np.ascontiguousarray(coffee[:36, :40, 0]),  # grayscale 36x40 -> 32 (log distance 0.34 vs 0.43)
    ]


EXPECTED_ROUTES = [(48, 48), (48, 48), (32, 32), (32, 32), (48, 48), (32, 32)]


@pytest.fixture(scope="module")
def pipeline(export_dir):
    with deploykit.load(export_dir, backend="ort", top_k=3, batch_size=2) as pipe:
        yield pipe


def reference(export_dir, image, resolution, k=3):
    """Preprocess + ONNX Runtime + softmax top-k, one image at a time (batch 1)."""
    logits = ort_logits(export_dir, preprocessed(export_dir, image, resolution)[None])
    return softmax_top_k(logits, k)[0]


def assert_same(prediction, expected):
    assert list(prediction.classes) == [c for c, _ in expected]
    np.testing.assert_allclose(prediction.scores, [p for _, p in expected], rtol=1e-5, atol=1e-7)


def test_batched_predictions_equal_direct_ort(pipeline, export_dir, images):
    predictions = pipeline(images)  # 6 images, 2 resolutions, batch_size 2: 3 + 3 runner calls
    assert [p.resolution for p in predictions] == EXPECTED_ROUTES
    for image, route, prediction in zip(images, EXPECTED_ROUTES, predictions):
        assert_same(prediction, reference(export_dir, image, route))
        assert 0 < sum(prediction.scores) <= 1 + 1e-6 and list(prediction.scores) == sorted(prediction.scores, reverse=True)


def test_every_input_kind_gives_the_same_answer(pipeline, export_dir, images, tmp_path):
    image = images[1]
    png = io.BytesIO()
    PIL.fromarray(image).save(png, format="PNG")  # lossless: decoded pixels are identical
    path = tmp_path / "chelsea.png"
    path.write_bytes(png.getvalue())
    expected = reference(export_dir, image, (48, 48))
    for item in (image, PIL.fromarray(image), png.getvalue(), path, str(path)):
        assert_same(pipeline(item), expected)
    rgba = np.concatenate([image, np.full(image.shape[:2] + (1,), 255, np.uint8)], axis=-1)
    assert_same(pipeline(rgba), expected)


def test_stacked_array_is_a_batch(pipeline, export_dir, images):
    batch = np.stack([images[2], images[2][::-1]])  # [2, 32, 32, 3]
    predictions = pipeline(batch)
    assert len(predictions) == 2
    assert_same(predictions[1], reference(export_dir, images[2][::-1], (32, 32)))


def test_logits_of_preprocessed_batch_equal_direct_ort(pipeline, export_dir):
    x = np.random.default_rng(0).standard_normal((5, 3, 48, 48), dtype=np.float32)
    np.testing.assert_array_equal(pipeline.logits(x)[:0], np.zeros((0, 10), np.float32))
    np.testing.assert_allclose(pipeline.logits(x), ort_logits(export_dir, x), rtol=1e-5, atol=1e-6)


def test_nearest_resolution_rule():
    resolutions = [(16, 16), (64, 64), (32, 96)]
    assert nearest_resolution((64, 64), resolutions) == (64, 64)  # exact match
    assert nearest_resolution((32, 32), [(16, 16), (64, 64)]) == (64, 64)  # log tie -> larger
    assert nearest_resolution((20, 20), resolutions) == (16, 16)
    assert nearest_resolution((30, 100), resolutions) == (32, 96)  # aspect ratio counts
    assert nearest_resolution((1000, 1000), resolutions) == (64, 64)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (np.zeros((32, 32, 3), np.float32), "uint8"),
        (np.zeros((32, 32, 2), np.uint8), "shape"),
        (np.zeros((0, 32, 3), np.uint8), "shape"),
        (b"definitely not an image", "cannot decode"),
        (12345, "unsupported image type"),
    ],
)
def test_bad_inputs_are_input_errors(pipeline, bad, needle):
    with pytest.raises(InputError, match=needle):
        pipeline(bad)


def test_logits_refuse_bad_tensors(pipeline):
    with pytest.raises(InputError, match="float32"):
        pipeline.logits(np.zeros((1, 3, 32, 32), np.float64))
    with pytest.raises(InputError, match="40"):
        pipeline.logits(np.zeros((1, 3, 40, 40), np.float32))


def test_auto_backend_falls_back_in_preference_order(export_dir):
    def unavailable(path):
        raise MissingDependencyError("tensorrt is not available")

    calls = []

    def ort(path):
        calls.append(path.name)
        return OnnxrtRunner(path)

    with Pipeline(export_dir, factories={"ort": ort, "trt": unavailable}) as pipe:
        assert pipe.backends == {(32, 32): "ort", (48, 48): "ort"}
        assert pipe.skipped[(32, 32)] == {"trt": "tensorrt is not available"}
    assert calls == ["model_32.onnx", "model_48.onnx"]
    with pytest.raises(DeployKitError, match="no backend could run.*tensorrt is not available"):
        Pipeline(export_dir, backend="trt", factories={"ort": ort, "trt": unavailable})
    with pytest.raises(ConfigError, match="auto, ort, trt"):
        Pipeline(export_dir, backend="nope", factories={"ort": ort, "trt": unavailable})


def test_import_deploykit_stays_light():
    """``deploykit.load`` and the pipeline module behind it load neither runtime until an export is opened."""
    code = (
        "import sys, deploykit, deploykit.serve.pipeline as p; assert callable(deploykit.load) and callable(p.load); "
        "print(sorted(m for m in ('onnxruntime', 'torch') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_serve_modules_import_no_optional_extra():
    heavy = ("pytriton", "tritonclient", "ray", "PIL")
    code = (
        "import sys, deploykit.cli, deploykit.serve, deploykit.serve.triton_server, deploykit.serve.triton_repo, "
        f"deploykit.serve.ray_serve; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"imported eagerly: {out}"


def test_sequence_model_export_is_refused_in_one_line(tmp_path):
    from deploykit.errors import ConfigError
    from deploykit.export import export
    from deploykit.nn import create_model

    export(create_model("seq_tiny_ega", depth=1), [(16,)], tmp_path)
    with pytest.raises(ConfigError, match="sequence model"):
        Pipeline(tmp_path)


# ----------------------------------------------------------------------------------------------
# threads, limits, what runs


def test_a_runner_shared_by_threads_is_entered_by_one_at_a_time(export_dir):
    """200 calls from 16 threads on one resolution: no call starts while another is running on
    the same runner, and every answer equals the sequential one."""
    from concurrent.futures import ThreadPoolExecutor

    from stand_in_runner import OverlapDetectingRunner

    runners = []

    def factory(path):
        runners.append(OverlapDetectingRunner(path))
        return runners[-1]

    inputs = np.random.default_rng(3).standard_normal((200, 1, 3, 32, 32), dtype=np.float32)
    with Pipeline(export_dir, backend="one-context", factories={"one-context": factory}) as pipe:
        sequential = [pipe.logits(x) for x in inputs]
        with ThreadPoolExecutor(16) as pool:
            concurrent = list(pool.map(pipe.logits, inputs))
    calls = sum(r.calls for r in runners)
    assert calls == 400, calls
    assert sum(r.overlaps for r in runners) == 0, "two threads were inside one runner at once"
    for got, want in zip(concurrent, sequential):
        np.testing.assert_array_equal(got, want)


def test_a_thread_safe_runner_is_not_serialised(export_dir):
    """A runner declaring ``thread_safe`` (an ONNX Runtime session) takes concurrent calls: two
    calls must be inside at once to pass the barrier, which a lock would never let happen."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(2, timeout=30)

    class MeetingRunner(OnnxrtRunner):
        thread_safe = True

        def _infer(self, feed):
            barrier.wait()  # BrokenBarrierError after 30 s if calls were serialised
            return super()._infer(feed)

    x = np.random.default_rng(4).standard_normal((2, 1, 3, 32, 32), dtype=np.float32)
    with Pipeline(export_dir, backend="meet", factories={"meet": MeetingRunner}) as pipe, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(pipe.logits, x))
    np.testing.assert_allclose(np.concatenate(results), ort_logits(export_dir, x[:, 0]), rtol=1e-5, atol=1e-6)


def test_describe_backends_names_the_choice_and_each_skip_once(export_dir):
    def unavailable(path):
        raise MissingDependencyError("tensorrt is not available")

    def stale(path):
        raise DeployKitError(f"engine for {path.name} is stale")

    with Pipeline(export_dir, factories={"ort": OnnxrtRunner, "trt": unavailable, "rtx": stale}) as pipe:
        assert pipe.describe_backends() == [
            "backend ort at 32, 48",
            "skipped trt at 32, 48: tensorrt is not available",
            "skipped rtx at 32: engine for model_32.onnx is stale",
            "skipped rtx at 48: engine for model_48.onnx is stale",
        ]


def test_images_over_the_limits_are_refused_before_decoding(export_dir, tmp_path):
    from deploykit.serve import ImageLimits
    from tests.test_imaging import png_header_only

    limits = ImageLimits(max_pixels=32 * 40, max_bytes=10_000)
    with deploykit.load(export_dir, backend="ort", limits=limits) as pipe:
        too_big = np.zeros((33, 40, 3), np.uint8)
        for item in (too_big, PIL.fromarray(too_big), png_header_only(40, 33)):
            with pytest.raises(InputError, match="40x33 = 1320 pixels; this server takes at most 1280"):
                pipe(item)
        path = tmp_path / "big.png"
        path.write_bytes(png_header_only(40, 33) + b"\0" * 10_000)
        with pytest.raises(InputError, match=f"{path}: image is 10001 bytes; this server takes at most 10000"):
            pipe(path)
        assert pipe(np.zeros((32, 40, 3), np.uint8)).resolution == (32, 32)  # at the limit: served
    with pytest.raises(ConfigError, match="max_pixels=0"):
        ImageLimits(max_pixels=0)


def test_an_image_that_fails_to_decode_is_one_input_error(pipeline):
    """Pillow raises ``SyntaxError`` on a PNG whose zTXt chunk names an unknown compression
    (issue 41): in-process that is one ``InputError``, from bytes or from a lazily opened PIL image."""
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    corrupt = png[:end] + image_bombs.png_chunk(b"zTXt", b"key\0\x01data") + png[end:]
    for item in (corrupt, [png, corrupt], PIL.open(io.BytesIO(corrupt))):
        with pytest.raises(InputError, match="^cannot decode image.*compression") as info:
            pipeline(item)
        assert "\n" not in str(info.value) and "/" not in str(info.value)


def test_inputs_beyond_the_bound_are_refused_before_the_model_runs(pipeline):
    """A finite 3e38 overflowed the model to NaN logits that were then ranked (issue 41)."""
    x = np.zeros((2, 3, 32, 32), np.float32)
    x[1, 0, 5, 5] = 3e38
    with pytest.raises(InputError, match=r"^images hold 1 values beyond ±10000; send normalised pixels$"):
        pipeline.logits(x)
    x[1, 0, 5, 5] = -1e4  # at the bound: served
    assert np.isfinite(pipeline.logits(x)).all()


def test_a_nan_answer_is_refused_not_ranked(export_dir, images):
    with Pipeline(export_dir, factories={"ort": NanRowRunner}) as pipe:
        with pytest.raises(DeployKitError, match=r"^the ort model at 32 answered NaN/Inf for 1 of 2 images \(first: 0\); not ranked$"):
            pipe.logits(np.zeros((2, 3, 32, 32), np.float32))
        with pytest.raises(DeployKitError, match="answered NaN/Inf"):
            pipe(images[2])
