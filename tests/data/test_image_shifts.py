"""Shifted test images (fedbayes.data.shift): level 0 is the clean set, rotations turn the image,
noise has its standard deviation, blur keeps the mean, contrast pulls toward it, all seeded."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbayes.data import shift as sh
from fedbayes.errors import DataError

SHAPES = ((3, 8, 8, 1), (2, 28, 28, 1), (2, 6, 6))  # digits, (Fashion-)MNIST, channel-less


def _images(seed, shape):
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(SHAPES), kind=st.sampled_from(sh.SHIFTS))
def test_level_zero_is_the_clean_set_and_others_change_it(seed, shape, kind):
    x = _images(seed, shape)
    clean = sh.shift_images(x, kind, 0, seed=seed)
    assert clean is not x and np.array_equal(clean, x)
    moved = sh.shift_images(x, kind, 3, seed=seed)  # (level 1's blur of 0.5 px of 28 barely moves an 8x8 image)
    assert moved.shape == x.shape and moved.dtype == x.dtype and not np.allclose(moved, x)


def test_rotation_turns_the_image_counter_clockwise():
    x = _images(0, (3, 8, 8, 1))
    assert np.allclose(sh.rotate(x, 90.0), np.rot90(x, 1, axes=(1, 2)), atol=1e-5)
    assert np.allclose(sh.rotate(x, 180.0), x[:, ::-1, ::-1], atol=1e-5)
    y = x
    for _ in range(4):
        y = sh.rotate(y, 90.0)
    assert np.allclose(y, x, atol=1e-5)
    # a bright pixel at the top of the middle column ends up on the left edge's middle row
    dot = np.zeros((1, 7, 7), np.float32)
    dot[0, 0, 3] = 1.0
    assert np.argwhere(sh.rotate(dot, 90.0)[0] > 0.99).tolist() == [[3, 0]]
    # 45 degrees: bilinear weights keep values in [0, 1]; the corners come from outside (0)
    turned = sh.rotate(x, 45.0)
    assert turned.min() >= 0.0 and turned.max() <= 1.0 and np.all(turned[:, 0, 0] == 0.0)


def test_noise_has_its_standard_deviation_and_is_seeded():
    x = np.full((4, 28, 28, 1), 0.5, np.float32)
    for level in (1, 2):  # 0.5 is 4 or more standard deviations from the clip at 0 and 1
        noisy = sh.shift_images(x, "noise", level, seed=3)
        assert abs(float((noisy - x).std()) - sh.intensity("noise", level)) < 0.005
        assert abs(float((noisy - x).mean())) < 0.005
    raw = sh.add_noise(x, 0.38, np.random.default_rng(0), clip=False)
    assert abs(float((raw - x).std()) - 0.38) < 0.01
    top = sh.shift_images(x, "noise", 5, seed=3)
    assert top.min() == 0.0 and top.max() == 1.0  # clipped back to the image range
    assert np.array_equal(sh.shift_images(x, "noise", 2, seed=3), sh.shift_images(x, "noise", 2, seed=3))
    assert not np.array_equal(sh.shift_images(x, "noise", 2, seed=3), sh.shift_images(x, "noise", 2, seed=4))
    for kind in ("rotation", "blur", "contrast"):  # nothing random: the seed does not matter
        assert np.array_equal(sh.shift_images(x, kind, 3, seed=0), sh.shift_images(x, kind, 3, seed=9))


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_blur_keeps_each_images_mean_and_smooths(shape):
    x = _images(1, shape)
    for level in sh.levels("blur")[1:]:
        b = sh.shift_images(x, "blur", level)
        assert np.allclose(b.mean(axis=(1, 2, 3)), x.mean(axis=(1, 2, 3)), atol=1e-6)
        assert b.std() < x.std() if level >= 3 else b.std() <= x.std()
    # the standard deviation scales with the image: sigma 3 px of 28 is 3 * 8 / 28 px on 8x8 digits
    assert np.allclose(sh.shift_images(x, "blur", 5), sh.blur(x, 3.0 * x.shape[1] / 28))
    with pytest.raises(DataError, match="wider than the 8x8 image"):
        sh.blur(x[:, :8, :8], 3.0)


def test_contrast_pulls_every_pixel_toward_its_images_mean():
    x = _images(2, (3, 28, 28, 1))
    m = x.mean(axis=(1, 2, 3), keepdims=True)
    for level in sh.levels("contrast")[1:]:
        c = sh.intensity("contrast", level)
        faded = sh.shift_images(x, "contrast", level)
        assert np.allclose(faded - m, c * (x - m), atol=1e-6)
        assert np.allclose(faded.mean(axis=(1, 2, 3)), m.ravel(), atol=1e-6)


def test_bad_input_is_one_line():
    with pytest.raises(DataError, match=r"dataset 'breast_cancer' holds no images \(features of shape \(30,\)") as exc:
        sh.shift_images(np.zeros((5, 30), np.float32), "noise", 1, name="breast_cancer")
    assert "\n" not in str(exc.value)
    with pytest.raises(DataError, match="unknown kind 'fog'; allowed: rotation, noise, blur, contrast"):
        sh.shift_images(np.zeros((2, 8, 8, 1), np.float32), "fog", 1)
    with pytest.raises(DataError, match=r"level 7 of 'rotation'; allowed: 0..6"):
        sh.intensity("rotation", 7)
