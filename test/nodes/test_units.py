"""Conversions, pairing, the action gate and the meters, without ROS processes."""

from __future__ import annotations

import struct
import types
import zlib

import numpy as np
import pytest

from physis_ros.nodes.conversions import (
    ConversionError,
    command_positions,
    compressed_msg_to_fields,
    fields_to_rgb,
    image_msg_to_fields,
    planar_fk,
    side_by_side,
    validate_vector,
)
from physis_ros.nodes.pairing import ApproxTimePairer, CommandHistory, Sample
from physis_ros.nodes.safety import ActionGate, SafetyConfig
from physis_ros.nodes.stats import Deliveries, DropCounter, RateMeter, RollingWindow

MS = 1_000_000


def raw_msg(pixels: np.ndarray, encoding: str, pad: int = 0):
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    padded = np.concatenate([rows, np.full((h, pad), 7, np.uint8)], axis=1)
    return types.SimpleNamespace(
        encoding=encoding, height=h, width=w, step=rows.shape[1] + pad, data=padded.tobytes()
    )


def test_padded_rows_are_stripped_and_colours_kept():
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    fields = image_msg_to_fields(raw_msg(rgb, "rgb8", pad=9))
    assert fields.step == 15 and len(fields.data) == 4 * 15
    np.testing.assert_array_equal(fields_to_rgb(fields), rgb)
    bgr = image_msg_to_fields(raw_msg(rgb[:, :, ::-1].copy(), "bgr8", pad=1))
    np.testing.assert_array_equal(fields_to_rgb(bgr), rgb)
    mono = image_msg_to_fields(raw_msg(rgb[:, :, 0].copy(), "mono8"))
    np.testing.assert_array_equal(fields_to_rgb(mono)[:, :, 2], rgb[:, :, 0])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"encoding": "yuv422"}, "bad_encoding"),
        ({"step": 10}, "bad_step"),
        ({"height": 5}, "bad_size"),
        ({"width": 0}, "bad_size"),
        ({"data": b"\x00" * 7}, "bad_size"),
    ],
)
def test_malformed_raw_images_are_refused_with_a_reason(change, reason):
    msg = raw_msg(np.zeros((4, 5, 3), np.uint8), "rgb8")
    for key, value in change.items():
        setattr(msg, key, value)
    with pytest.raises(ConversionError) as err:
        image_msg_to_fields(msg)
    assert err.value.reason == reason


def _png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    )


def _jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + bytes(9)
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof0 + b"\xff\xd9"


def test_compressed_images_are_measured_from_their_headers():
    png = compressed_msg_to_fields(types.SimpleNamespace(format="png", data=_png(64, 48)))
    assert (png.encoding, png.height, png.width, png.step) == ("png", 48, 64, 0)
    jpg = compressed_msg_to_fields(
        types.SimpleNamespace(format="rgb8; jpeg compressed bgr8", data=_jpeg(640, 480))
    )
    assert (jpg.encoding, jpg.height, jpg.width) == ("jpeg", 480, 640)
    for fmt, data, reason in [
        ("tiff", _png(4, 4), "bad_encoding"),
        ("jpeg", b"not a jpeg", "bad_compressed"),
        ("png", _jpeg(4, 4), "bad_compressed"),
    ]:
        with pytest.raises(ConversionError) as err:
            compressed_msg_to_fields(types.SimpleNamespace(format=fmt, data=data))
        assert err.value.reason == reason


def test_nan_vectors_are_refused():
    with pytest.raises(ConversionError, match="nan_wrench"):
        validate_vector([0, 0, float("nan"), 0, 0, 0], size=6, reason="nan_wrench")
    with pytest.raises(ConversionError):
        validate_vector([0, 1], size=3, reason="bad_joints")
    assert validate_vector([1, 2, 3], size=3, reason="x").tolist() == [1, 2, 3]


def test_side_by_side_and_forward_kinematics():
    observed = np.full((480, 640, 3), 10, np.uint8)
    predicted = np.full((16, 16, 3), 200, np.uint8)
    view = side_by_side(observed, predicted, height=120)
    assert view.shape == (120, 160 + 2 + 120, 3)
    assert view[0, 0, 0] == 10 and view[0, 161, 0] == 255 and view[0, -1, 0] == 200
    xy = planar_fk(np.array([[0.0, 0.0], [np.pi / 2, -np.pi / 2]]), (0.38, 0.32), (0.0, -0.5))
    np.testing.assert_allclose(xy, [[0.70, -0.5], [0.32, -0.12]], atol=1e-12)


def _pairer(drops, **kw):
    return ApproxTimePairer(
        slop_s=0.02,
        require_wrench=kw.get("wrench", True),
        require_joints=True,
        objects=("box",),
        require_object=kw.get("object", False),
        drops=drops,
    )


def s(stamp_ms: float, value="x") -> Sample:
    return Sample(stamp_ns=int(stamp_ms * MS), value=value, received_s=0.0)


def test_pairing_takes_nearest_within_slop_and_waits_for_late_partners():
    drops = DropCounter()
    pairer = _pairer(drops)
    for t in (0, 10, 20, 30):
        assert pairer.add_aux("wrench", s(t, f"w{t}")) is None
        assert pairer.add_aux("joints", s(t + 1, f"j{t}")) is None
    paired = pairer.add_image(s(22))
    assert paired.wrench.value == "w20" and paired.joints.value == "j20"
    # an image ahead of its partners waits, and pairs when they arrive
    assert pairer.add_image(s(100)) is None
    assert pairer.add_aux("wrench", s(99, "w99")) is None
    paired = pairer.add_aux("joints", s(101, "j101"))
    assert paired.image.stamp_ns == 100 * MS and paired.joints.value == "j101"
    assert drops.snapshot() == {}


def test_pairing_counts_out_of_order_and_unpaired():
    drops = DropCounter()
    pairer = _pairer(drops)
    pairer.add_aux("wrench", s(0))
    pairer.add_aux("joints", s(0))
    assert pairer.add_image(s(1)) is not None
    assert pairer.add_image(s(1)) is None  # same stamp again
    assert pairer.add_image(s(0.5)) is None  # older
    assert pairer.add_aux("wrench", s(0)) is None  # older wrench
    assert drops.snapshot() == {"out_of_order_stamp": 3}
    assert pairer.add_image(s(500)) is None  # no partner: waits
    assert pairer.add_image(s(600)) is None  # replaces the waiting one
    pairer.add_aux("wrench", s(700))  # partner beyond the slop: the waiting one is lost
    assert drops.snapshot() == {"out_of_order_stamp": 3, "unpaired": 2}


def test_optional_partner_is_attached_when_near_and_skipped_when_not():
    drops = DropCounter()
    pairer = _pairer(drops, wrench=False)
    pairer.add_aux("joints", s(10))
    paired = pairer.add_image(s(10))
    assert paired.wrench is None and paired.joints is not None


def test_an_object_position_pairs_like_the_wrench_and_is_optional_unless_required():
    drops = DropCounter()
    pairer = _pairer(drops)
    for stream in ("wrench", "joints"):
        pairer.add_aux(stream, s(10))
    assert pairer.add_image(s(10)).objects == {}  # no tracker: the image goes
    required = _pairer(drops, object=True)
    for stream in ("wrench", "joints"):
        required.add_aux(stream, s(10))
    assert required.add_image(s(10)) is None  # waits for the tracker
    paired = required.add_aux("object:box", s(12, "box"))
    assert paired.objects["box"].value == "box" and drops.snapshot() == {}


def test_command_history_takes_the_newest_command_strictly_before_the_image():
    history = CommandHistory(max_age_s=0.05)
    assert history.before(100 * MS) == (None, "none_before_image")
    assert history.add(10 * MS, "a") and history.add(20 * MS, "b") and history.add(40 * MS, "c")
    assert not history.add(40 * MS, "again") and not history.add(30 * MS, "older")
    # equal stamp: the command of that tick is applied after the image (as in the bags)
    assert history.before(40 * MS) == ("b", "")
    assert history.before(41 * MS) == ("c", "")
    assert history.before(15 * MS) == ("a", "")
    assert history.before(10 * MS) == (None, "none_before_image")
    assert history.before(91 * MS) == (None, "stale")  # c is 51 ms old
    assert history.before(90 * MS) == ("c", "")


def test_command_positions_are_taken_by_name_in_the_action_order():
    picked = command_positions(
        ["elbow", "wrist", "shoulder"], [[0.5, 9.0, -1.25]], ("shoulder", "elbow")
    )
    assert picked.dtype == np.float32 and picked.tolist() == [-1.25, 0.5]
    # several points: the first is the one in force at the stamp
    assert command_positions(["a"], [[1.0], [2.0]], ("a",)).tolist() == [1.0]
    cases = [
        ((["shoulder"], [[0.1]], ("shoulder", "elbow")), "command:missing_joint"),
        ((["shoulder", "elbow"], [], ("shoulder", "elbow")), "command:no_points"),
        ((["shoulder", "elbow"], [[0.1]], ("shoulder", "elbow")), "command:bad_positions"),
        (
            (["shoulder", "elbow"], [[0.1, float("nan")]], ("shoulder", "elbow")),
            "command:non_finite",
        ),
    ]
    for args, reason in cases:
        with pytest.raises(ConversionError) as err:
            command_positions(*args)
        assert err.value.reason == reason, args
    with pytest.raises(ConversionError, match=r"lacks \['elbow'\]"):
        command_positions(["shoulder"], [[0.1]], ("shoulder", "elbow"))


def test_gate_trims_past_rows_and_refuses_old_or_stale_chunks():
    gate = ActionGate(SafetyConfig(deadline_s=0.2, max_observation_age_s=1.0))
    actions = np.arange(8, dtype=np.float32).reshape(4, 2)
    now = 10_000 * MS
    ok = gate.on_chunk(now_ns=now, chunk_index=0, actions=actions, start_ns=now + 5 * MS,
                       dt_s=0.01, observation_stamp_ns=now - 500 * MS)  # fmt: skip
    assert ok.publish and ok.start_ns == now + 5 * MS and ok.actions.shape == (4, 2)
    trimmed = gate.on_chunk(now_ns=now, chunk_index=1, actions=actions, start_ns=now - 15 * MS,
                            dt_s=0.01, observation_stamp_ns=now)  # fmt: skip
    assert trimmed.publish and trimmed.start_ns == now + 5 * MS
    np.testing.assert_array_equal(trimmed.actions, actions[2:])
    expired = gate.on_chunk(now_ns=now, chunk_index=2, actions=actions, start_ns=now - 40 * MS,
                            dt_s=0.01, observation_stamp_ns=now)  # fmt: skip
    assert not expired.publish and expired.reason == "expired_rows"
    old = gate.on_chunk(now_ns=now, chunk_index=1, actions=actions, start_ns=now, dt_s=0.01,
                        observation_stamp_ns=now)  # fmt: skip
    assert old.reason == "out_of_order_chunk"
    stale = gate.on_chunk(now_ns=now, chunk_index=5, actions=actions, start_ns=now, dt_s=0.01,
                          observation_stamp_ns=now - 1500 * MS)  # fmt: skip
    assert stale.reason == "stale_observation"
    gate.reset_stream()
    assert gate.on_chunk(now_ns=now, chunk_index=0, actions=actions, start_ns=now, dt_s=0.01,
                         observation_stamp_ns=now).publish  # fmt: skip


def test_gate_goes_stale_once_after_the_deadline_and_recovers():
    gate = ActionGate(SafetyConfig(fallback="zeros"))
    gate.set_interval(0.05)  # deadline: two intervals
    assert gate.deadline_s == pytest.approx(0.1)
    assert not gate.check_deadline(0)  # nothing arrived yet: nothing to miss
    actions = np.ones((2, 2), np.float32)
    gate.on_chunk(now_ns=0, chunk_index=0, actions=actions, start_ns=0, dt_s=0.01,
                  observation_stamp_ns=0)  # fmt: skip
    assert not gate.check_deadline(99 * MS)
    assert gate.check_deadline(101 * MS) and gate.stale
    assert not gate.check_deadline(150 * MS)  # once per outage
    assert gate.fallback_actions(horizon=3, dim=2, held=np.array([1.0, 2.0])).sum() == 0
    gate.on_chunk(now_ns=200 * MS, chunk_index=1, actions=actions, start_ns=200 * MS, dt_s=0.01,
                  observation_stamp_ns=0)  # fmt: skip
    assert not gate.stale
    hold = ActionGate(SafetyConfig(deadline_s=1.0, fallback="hold"))
    rows = hold.fallback_actions(horizon=2, dim=3, held=np.array([0.5, -0.5]))
    np.testing.assert_array_equal(rows, [[0.5, -0.5, 0.0], [0.5, -0.5, 0.0]])


def test_a_new_prompt_gives_the_next_stream_a_whole_deadline():
    gate = ActionGate(SafetyConfig(deadline_s=0.1))
    gate.restart_deadline(0)  # before the first chunk the deadline is not running
    assert not gate.armed() and not gate.check_deadline(10_000 * MS)
    actions = np.ones((2, 2), np.float32)
    gate.on_chunk(now_ns=0, chunk_index=0, actions=actions, start_ns=0, dt_s=0.01,
                  observation_stamp_ns=0)  # fmt: skip
    gate.restart_deadline(80 * MS)  # the goal changed 80 ms after the last chunk
    gate.restart_deadline(50 * MS)  # an earlier time never moves the deadline back
    assert not gate.check_deadline(170 * MS)  # past the old stream's deadline: no fallback
    assert gate.check_deadline(181 * MS)  # the new stream did not start within its own


def test_configs_name_the_bad_value():
    with pytest.raises(ValueError, match="fallback 'brake'"):
        SafetyConfig(fallback="brake")
    with pytest.raises(ValueError, match="slop_s"):
        ApproxTimePairer(slop_s=0, require_wrench=True, require_joints=True, drops=DropCounter())


def test_meters():
    window = RollingWindow(size=100)
    for v in range(1, 101):
        window.add(v)
    summary = window.summary()
    assert summary["median"] == 50.5 and 99 <= summary["p99"] <= 100
    meter = RateMeter(window_s=1.0)
    for i in range(30):
        meter.tick(10.0 + i / 30)
    assert meter.rate_hz(now_s=11.0) == pytest.approx(29, abs=1)
    assert meter.rate_hz(now_s=13.0) == 0


def test_area_resize_averages_and_keeps_the_encoding():
    from physis_ros.nodes.conversions import ImageFields, resize_area_sampled, resize_fields

    # a 640x480 checkerboard of 40x30 tiles: each output pixel of a 16x16 image is one tile
    tiles = (np.add.outer(np.arange(480) // 30, np.arange(640) // 40) % 2 * 200).astype(np.uint8)
    image = np.repeat(tiles[:, :, None], 3, axis=2)
    small = resize_area_sampled(image, 16, 16)
    np.testing.assert_array_equal(
        small[:, :, 0], (np.add.outer(np.arange(16), np.arange(16)) % 2) * 200
    )
    # a fine stripe pattern averages to grey instead of aliasing
    stripes = np.zeros((64, 64, 3), np.uint8)
    stripes[:, ::2] = 255
    assert np.all(np.abs(resize_area_sampled(stripes, 16, 16).astype(int) - 128) <= 1)
    bgr = ImageFields(encoding="bgr8", height=480, width=640, step=1920, data=image.tobytes())
    out = resize_fields(bgr, 16, 16)
    assert (out.encoding, out.height, out.width, out.step, len(out.data)) == (
        "bgr8",
        16,
        16,
        48,
        768,
    )
    png = ImageFields(encoding="png", height=4, width=4, step=0, data=b"x")
    assert resize_fields(png, 16, 16) is png  # compressed images go as they are


def test_demo_png_writer_round_trips_through_pillow(tmp_path):
    from PIL import Image as PILImage

    from physis_ros.demo import strip, write_png

    rows = [np.full((8, 10, 3), v, np.uint8) for v in (10, 200)]
    image = strip(rows, scale=2)
    assert image.shape == (2 * (8 + 2) * 2, 20, 3)
    write_png(tmp_path / "s.png", image)
    np.testing.assert_array_equal(np.asarray(PILImage.open(tmp_path / "s.png")), image)


def test_server_faults_are_what_diagnostics_warns_about():
    """/diagnostics' link status warns about the server's drops that are faults (a tensor it
    refused, an image it could not decode, NaN output), not about newest-wins pacing."""
    from physis_ros.nodes.bridge_report import server_faults

    link = types.SimpleNamespace(
        drops={
            "server:superseded": 40,
            "server:client_slow": 2,
            "server:bad_tensor": 3,
            "server:non_finite_output": 1,
            "server:image_decode": 0,
            "client:oversized": 5,
        }
    )
    assert server_faults(link) == {"bad_tensor": 3, "non_finite_output": 1}
    assert server_faults(types.SimpleNamespace(drops={"server:superseded": 9})) == {}


def test_a_rollout_is_one_delivery_and_each_new_anchor_another():
    """Rollouts: the chunks of one anchor after its first are the rest of that delivery; a
    new anchor, a new stream or a prediction without an anchor is a new one."""
    d = Deliveries()
    seen = [(1, 0), (1, 0), (1, 0), (1, 1), (1, 1), (2, 1), (2, -1), (2, -1), (2, 2)]
    assert [d.is_new(s, a) for s, a in seen] == [
        True, False, False, True, False, True, True, True, True
    ]  # fmt: skip


def test_the_demo_strip_keeps_few_evenly_spaced_rows_however_long_it_runs():
    from physis_ros.demo import StripRows

    short = StripRows(limit=8)
    for second in range(8):
        short.offer(np.full((1, 1, 3), second, np.uint8))
    assert [int(r[0, 0, 0]) for r in short.rows] == list(range(8))  # all of them, as before
    long = StripRows(limit=8)
    for second in range(100):
        long.offer(np.full((1, 1, 3), second, np.uint8))
    kept = [int(r[0, 0, 0]) for r in long.rows]
    assert len(kept) <= 8 and kept[0] == 0 and kept[-1] >= 80
    assert len(set(np.diff(kept))) == 1  # evenly spaced
