"""deploykit's Triton Python-backend models, driven in-process with a batch as Triton's stub drives
them (``python_backend.py``): ``classify`` of ``deploykit serve`` and the packaged repository's
``preprocess_<res>``. One client's image, however broken, fails that client's request alone
(issue 41: a PNG with a corrupt chunk failed 24 of 100 valid requests batched beside it); a model
answer holding NaN/Inf is refused, never ranked."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
from python_backend import Request, answered, images_request, load_model
from stand_in_runner import NanRowRunner

import deploykit
from deploykit.answers import top_k
from tests import image_bombs

VALID = 12  # valid requests in each batch, the poisoned one in the middle
PATH = re.compile(r"/\w+/|\.py\b|site-packages")


def corrupt_chunk_png() -> bytes:
    """A 48x48 PNG with a zTXt chunk after its image data whose compression method is unknown:
    Pillow raises ``SyntaxError`` while decoding the pixels (issue 41, finding 1)."""
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    return png[:end] + image_bombs.png_chunk(b"zTXt", b"key\0\x01data") + png[end:]


POISONED = {
    "corrupt chunk": corrupt_chunk_png,
    "not an image": lambda: b"\x89PNG\r\n\x1a\n but no chunks",
    "scan bomb": lambda: image_bombs.progressive_jpeg(1_000),
    "animated": lambda: image_bombs.animated("WEBP", 3),
}


@pytest.fixture(scope="module")
def pipeline(export_dir):
    with deploykit.load(export_dir, backend="ort", top_k=3) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def valid_images() -> list[bytes]:
    return [image_bombs.encoded("PNG", size, seed=i) for i, size in enumerate([(40, 40), (50, 70), (32, 32)] * (VALID // 3))]


def classify_model(pipeline, monkeypatch):
    from deploykit.serve.triton_server import CLASSIFY_MODEL_SOURCE, ServerOptions, classify_config

    text = classify_config(pipeline, ServerOptions(top_k=3))
    settings = json.loads(text.split("string_value: ", 1)[1].rsplit(" }", 2)[0])
    return load_model(CLASSIFY_MODEL_SOURCE, {"parameters": {"settings": {"string_value": settings}}}, monkeypatch, pipeline)


def preprocess_model(pipeline, monkeypatch, resolution=(32, 32)):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from deploykit.serve.triton_repo import PREPROCESS_MODEL_SOURCE, RepositoryOptions, preprocess_config

    text = preprocess_config("preprocess_32", resolution, pipeline.config, RepositoryOptions())
    config = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()), preserving_proto_field_name=True)
    return load_model(PREPROCESS_MODEL_SOURCE, config, monkeypatch)


def assert_client_error(response, needle: str):
    assert response.has_error()
    message = response.error().message()
    assert response.error().code() == "INVALID_ARG" and needle in message, message
    assert "\n" not in message and "Traceback" not in message and not PATH.search(message), message


@pytest.mark.parametrize("poison", POISONED)
def test_a_poisoned_request_fails_alone_in_a_classify_batch(pipeline, valid_images, monkeypatch, poison):
    model = classify_model(pipeline, monkeypatch)
    requests = [images_request(data) for data in valid_images]
    requests.insert(VALID // 2, images_request(valid_images[0], POISONED[poison]()))  # a valid image beside it fails with it
    responses = answered(model, requests)
    assert len(responses) == VALID + 1
    assert_client_error(responses.pop(VALID // 2), "")
    failed = [r.error().message() for r in responses if r.has_error()]
    assert failed == []
    for data, response in zip(valid_images, responses):
        expected = pipeline(data)
        classes = {t.name: t.as_numpy() for t in response.output_tensors}
        assert classes["classes"].tolist() == [list(expected.classes)]
        assert classes["resolution"].tolist() == [list(expected.resolution)]


def test_classify_says_why_an_image_was_refused(pipeline, monkeypatch):
    model = classify_model(pipeline, monkeypatch)
    responses = answered(model, [images_request(data()) for data in POISONED.values()])
    needles = ["cannot decode image bytes: ", "cannot decode image bytes: ", "scans; this server takes at most", "animated (3 frames)"]
    for response, needle in zip(responses, needles):
        assert_client_error(response, needle)


def test_a_nan_answer_is_refused_not_ranked_by_classify(export_dir, valid_images, monkeypatch):
    """The model answers NaN for one image: its call fails (a model fault) and nothing is ranked."""
    with deploykit.load(export_dir, factories={"ort": NanRowRunner}, top_k=3) as pipe:
        responses = answered(classify_model(pipe, monkeypatch), [images_request(data) for data in valid_images[:2]])
    for response in responses:
        assert response.has_error() and not response.output_tensors
        message = response.error().message()
        assert re.fullmatch(
            r"logits_\d+ failed: the ort model at \d+ answered NaN/Inf for 1 of \d+ images \(first: 0\); not ranked", message
        )


@pytest.mark.parametrize("poison", POISONED)
def test_a_poisoned_request_fails_alone_in_a_preprocess_batch(pipeline, valid_images, monkeypatch, poison):
    model = preprocess_model(pipeline, monkeypatch)
    requests = [images_request(data) for data in valid_images[:4]]
    requests.insert(2, images_request(POISONED[poison]()))
    responses = model.execute(requests)
    assert_client_error(responses.pop(2), "")
    for data, response in zip(valid_images, responses):
        assert not response.has_error()
        expected = pipeline.preprocess(deploykit.inputs.imaging.decode(data), (32, 32))
        np.testing.assert_array_equal(response.output_tensors[0].as_numpy(), expected[None])


def test_any_failure_of_one_preprocess_request_is_that_requests_error(pipeline, monkeypatch, capsys):
    """A request Triton should never send (no ``image`` input): its own error, naming the
    exception's type only; the traceback goes to the stub's stderr (Triton's log)."""
    from python_backend import Request

    model = preprocess_model(pipeline, monkeypatch)
    good = image_bombs.encoded("PNG", (40, 40))
    responses = model.execute([images_request(good), Request({}), images_request(good)])
    assert_client_error(responses[1], "cannot preprocess this request's images (AttributeError)")
    assert not responses[0].has_error() and not responses[2].has_error()
    assert "Traceback" in capsys.readouterr().err


def test_classify_answers_the_others_when_preparing_one_request_fails(pipeline, monkeypatch):
    """Preprocessing raising something of its own (not ``ImageRejected``) fails that request alone."""
    model = classify_model(pipeline, monkeypatch)
    real, poisoned = model._prepare, image_bombs.encoded("PNG", (33, 33))

    def prepare(data):
        if bytes(data) == poisoned:
            raise MemoryError
        return real(data)

    monkeypatch.setattr(model, "_prepare", prepare)
    requests = [images_request(image_bombs.encoded("PNG", (40, 40))), images_request(poisoned), images_request(image_bombs.encoded("PNG"))]
    responses = answered(model, requests)
    assert_client_error(responses[1], "cannot prepare this request's images (MemoryError)")
    assert not responses[0].has_error() and not responses[2].has_error()


def test_a_slow_image_does_not_hold_the_decode_of_the_others_in_its_batch(pipeline, monkeypatch):
    """The first image's decode cannot finish until the last one's has run (a stub decoder): the
    batch is answered only if its images are prepared at the same time, not one after another."""
    model = classify_model(pipeline, monkeypatch)
    real, slow, fast = model._prepare, image_bombs.encoded("PNG", (40, 40)), image_bombs.encoded("PNG", (32, 32))
    others_done = threading.Event()

    def prepare(data):
        if bytes(data) == slow:
            if not others_done.wait(30):
                raise TimeoutError("the slow image was decoded alone: the others waited behind it")
        else:
            others_done.set()
        return real(data)

    monkeypatch.setattr(model, "_prepare", prepare)
    responses = answered(model, [images_request(slow), images_request(fast)])
    assert [r.has_error() for r in responses] == [False, False], [r.error().message() for r in responses if r.has_error()]
    assert [t.as_numpy().tolist() for t in responses[1].output_tensors if t.name == "resolution"] == [[[32, 32]]]
    model.finalize()


def logits_model(settings: dict, monkeypatch):
    from deploykit.serve.triton_server import LOGITS_MODEL_SOURCE

    return load_model(LOGITS_MODEL_SOURCE, {"parameters": {"settings": {"string_value": json.dumps(settings)}}}, monkeypatch)


def test_the_logits_model_refuses_a_requests_unusable_pixels_and_answers_the_others(pipeline, monkeypatch):
    """``logits_<res>`` in Triton's Python backend, as ``deploykit serve`` writes it for a CPU plan:
    the requests of one batch run in one call; a request with NaN or huge pixels fails alone."""
    from deploykit.serve.triton_server import ServerOptions, logits_config

    config = logits_config(pipeline, (32, 32), ServerOptions(top_k=3))
    model = logits_model(json.loads(json.loads(config.split("string_value: ", 1)[1].rsplit(" }", 2)[0])), monkeypatch)
    rng = np.random.default_rng(3)
    good, pair = rng.standard_normal((1, 3, 32, 32), dtype=np.float32), rng.standard_normal((2, 3, 32, 32), dtype=np.float32)
    nan, huge = good.copy(), good.copy()
    nan[0, 0, 0, 0], huge[0, 1, 2, 3] = np.nan, 3e38
    responses = model.execute([Request({"images": x}) for x in (good, nan, pair, huge)])
    assert_client_error(responses[1], "images hold 1 NaN/Inf values; send finite numbers")
    assert_client_error(responses[3], "images hold 1 values beyond ±10000; send normalised pixels")
    for response, x in ((responses[0], good), (responses[2], pair)):
        outputs = {t.name: t.array for t in response.output_tensors}
        np.testing.assert_allclose(outputs["logits"], pipeline.logits(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(outputs["classes"], top_k(pipeline.logits(x), 3)[0])
    model.finalize()


def test_the_logits_model_spreads_a_merged_batch_over_the_streams_and_answers_each_request(export_dir, monkeypatch):
    """ONNX Runtime with two streams as served: the stub's runner spreads the batch of four requests
    (five images) over its streams, a lone image runs on all cores, and every request gets the
    logits the one-stream pipeline computes for its images, and only the outputs it asked for."""
    from deploykit.serve.triton_server import ServerOptions, logits_config

    with deploykit.load(export_dir, backend="ort", streams=2, top_k=3) as pipe, deploykit.load(export_dir, backend="ort", top_k=3) as one:
        config = logits_config(pipe, (32, 32), ServerOptions(top_k=3))
        model = logits_model(json.loads(json.loads(config.split("string_value: ", 1)[1].rsplit(" }", 2)[0])), monkeypatch)
        assert model.runner.spreads_batches and model.runner.parallel_calls == 2
        rng = np.random.default_rng(5)
        images = [rng.standard_normal((n, 3, 32, 32), dtype=np.float32) for n in (1, 2, 1, 1)]
        for requests in (images, images[:1]):
            asked = [("logits",), ()] * 2  # one client names its output, the next names none: all three
            responses = model.execute([Request({"images": x}, outputs) for x, outputs in zip(requests, asked)])
            for response, x, outputs in zip(responses, requests, asked):
                answer = {t.name: t.array for t in response.output_tensors}
                assert sorted(answer) == sorted(outputs or ("logits", "classes", "scores"))
                np.testing.assert_allclose(answer["logits"], one.logits(x), rtol=1e-5, atol=1e-6)
        model.finalize()


def test_a_nan_answer_of_the_logits_model_fails_only_the_requests_it_spoils(tmp_path, monkeypatch):
    """A model that answers NaN for some rows (here log of a negative sum) fails the requests those
    rows belong to, in one line; the other requests of the batch get their ranking."""
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["images", "axes"], ["sums"], keepdims=0), helper.make_node("Log", ["sums"], ["logits"])],
        "log_of_sums",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "log.onnx")
    settings = dict(backend="ort", graph=str(tmp_path / "log.onnx"), streams=1, threads=0, top_k=2, label="ort model at 4")
    model = logits_model(settings, monkeypatch)
    positive, mixed = np.ones((1, 3, 4, 4), np.float32), np.ones((2, 3, 4, 4), np.float32)
    mixed[1, 0] = -1.0  # channel 0 of the second image sums to -16: its log is NaN
    ok, spoiled = model.execute([Request({"images": positive}), Request({"images": mixed})])
    message = spoiled.error().message()
    assert spoiled.has_error() and message == "the ort model at 4 answered NaN/Inf for 1 of 2 images (first: 1); not ranked"
    outputs = {t.name: t.array for t in ok.output_tensors}
    np.testing.assert_allclose(outputs["logits"], np.full((1, 3), np.log(16.0)), rtol=1e-6)
    assert outputs["classes"].shape == (1, 2) and np.allclose(outputs["scores"], 1 / 3)


def test_one_request_s_decode_work_is_bounded_and_its_images_take_turns_with_others(pipeline, valid_images, monkeypatch):
    """Item 3 of issue 52: the bounds held per image, so one request of 32 worst-case images took
    minutes of decoding, and a valid request batched with it waited for all of them (194 s). A
    request whose images hold more than ``REQUEST_IMAGES_OF_MAX`` largest images' pixels is
    refused before anything is decoded; the others of its batch are answered, and the decode pool
    takes every request's first image before any request's second."""
    from deploykit.inputs.imaging import REQUEST_IMAGES_OF_MAX
    from deploykit.serve.classifier import ImageLimits
    from deploykit.serve.triton_classify_model import Turns
    from deploykit.serve.triton_server import CLASSIFY_MODEL_SOURCE, ServerOptions, classify_config

    side = 50 * 70  # each image below is 50 x 70: within the per-image bound of 1.5 such images
    limits = ImageLimits(max_pixels=side * 3 // 2)
    text = classify_config(pipeline, ServerOptions(top_k=3, limits=limits))
    settings = json.loads(text.split("string_value: ", 1)[1].rsplit(" }", 2)[0])
    model = load_model(CLASSIFY_MODEL_SOURCE, {"parameters": {"settings": {"string_value": settings}}}, monkeypatch, pipeline)
    image = image_bombs.encoded("PNG", (50, 70))
    fits = REQUEST_IMAGES_OF_MAX * limits.max_pixels // side  # images of this size one request may hold
    model.decoders.close()
    model.decoders = Turns(1)  # one thread: the order images are taken in is the order they are prepared in
    order, prepare = [], model._prepare

    def recorded(data):
        order.append(bytes(data))
        return prepare(data)

    monkeypatch.setattr(model, "_prepare", recorded)
    small = image_bombs.encoded("PNG", (32, 32))
    responses = answered(model, [images_request(*[image] * (fits + 1)), images_request(*[image] * fits), images_request(small)])
    assert_client_error(responses[0], f"this request's {fits + 1} images hold {(fits + 1) * side:,} pixels; this server decodes at most")
    assert not responses[1].has_error() and not responses[2].has_error()
    assert order.index(small) <= 1  # in the first round: after the other request's first image, not its last
    model.finalize()


def test_a_request_is_answered_while_an_earlier_ones_images_still_decode(pipeline, monkeypatch):
    """Item 3 of issue 52: a valid request waited for every image of the requests batched with it,
    and a request arriving during a batch for that whole batch (194 s behind 32 worst-case images).
    ``execute`` now returns at once and each request is answered when its own images are ready:
    here a heavy request's first image cannot finish until a small request has arrived in a later
    ``execute`` (Triton calls an instance's ``execute`` one batch at a time), and the small one,
    taken in turn after at most the heavy one's next image, is answered before the heavy one's six are."""
    from deploykit.serve.triton_classify_model import Turns

    model = classify_model(pipeline, monkeypatch)
    model.decoders.close()
    model.decoders = Turns(1)  # the worst case: every decode thread busy with the heavy request
    heavy, small = image_bombs.encoded("PNG", (40, 40)), image_bombs.encoded("PNG", (32, 32))
    arrived, order, prepare = threading.Event(), [], model._prepare

    def prepared(data):
        if bytes(data) == heavy and not order and not arrived.wait(5):
            raise TimeoutError("execute held the instance until the heavy request's images were decoded")
        order.append("small" if bytes(data) == small else "heavy")
        return prepare(data)

    monkeypatch.setattr(model, "_prepare", prepared)
    first, second = images_request(*[heavy] * 6), images_request(small)
    assert model.execute([first]) is None  # main: blocked here until the wait above gave up
    model.execute([second])
    arrived.set()
    responses = [request.sender.wait(30) for request in (first, second)]
    assert [r.has_error() for r in responses] == [False, False], [r.error().message() for r in responses if r.has_error()]
    # the heavy request's second image may have been taken before the small one arrived, no more
    assert order.count("heavy") == 6 and order.index("small") in (1, 2), order
    assert second.sender.order < first.sender.order
    model.finalize()


def test_the_packaged_preprocess_model_bounds_a_request_s_pixels_too(pipeline, monkeypatch):
    from deploykit.inputs.imaging import MAX_PIXELS, REQUEST_IMAGES_OF_MAX

    model = preprocess_model(pipeline, monkeypatch)
    assert model.max_request_pixels == REQUEST_IMAGES_OF_MAX * MAX_PIXELS
    model.max_request_pixels = 2 * 40 * 40  # as a repository packaged with --max-image-pixels 1600 would hold
    image = image_bombs.encoded("PNG", (40, 40))
    responses = model.execute([images_request(image, image, image), images_request(image, image)])
    assert_client_error(responses[0], "this request's 3 images hold 4,800 pixels; this server decodes at most 3,200 per request")
    assert not responses[1].has_error()
