"""Models by name, datasets with per-sample seeded augmentation, and the bf16 CPU step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from elastictrain.config import ConfigError
from elastictrain.engine.data import SeededImageFolder, SyntheticImages, image_transforms
from elastictrain.engine.models import build_model
from elastictrain.engine.step import Precision, train_step
from elastictrain.tasks.image import ImageTaskArgs, build_datasets


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_models_by_name_produce_logits(name):
    model = build_model(name, 7)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)


def test_unknown_model_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"task_args.model: unknown architecture 'resnet19' \(did you mean"):
        build_model("resnet19", 10)


def test_synthetic_samples_are_a_pure_function_of_their_id():
    a, b = SyntheticImages(64, 5, 8, seed=1), SyntheticImages(64, 5, 8, seed=1)
    xa, ya = a[17]
    xb, yb = b[17]
    assert torch.equal(xa, xb) and ya == yb


def write_folder(root, n=6):
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(n):
            arr = (np.random.default_rng(i).random((20, 20, 3)) * 255).astype("uint8")
            Image.fromarray(arr).save(root / c / f"{i}.png")


def test_image_folder_augmentation_depends_on_sample_and_epoch_not_on_load_order(tmp_path):
    write_folder(tmp_path)
    ds = SeededImageFolder(str(tmp_path), image_transforms(16, train=True, augment=True), seed=3)
    first = ds[4][0]
    torch.manual_seed(999)  # the process RNG does not matter
    _ = ds[1]
    assert torch.equal(ds[4][0], first)
    ds.set_epoch(1)
    assert not torch.equal(ds[4][0], first)


def test_missing_image_folder_is_a_config_error(tmp_path):
    train, _ = build_datasets(ImageTaskArgs(data="image_folder", path=str(tmp_path / "nope")), 0)  # scanned lazily
    with pytest.raises(ConfigError, match=r"task_args\.path: .* is not a directory"):
        len(train)


def test_bf16_autocast_step_on_cpu_learns():
    torch.manual_seed(0)
    model = build_model("small_cnn", 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    prec = Precision.resolve("fp16", torch.device("cpu"))
    assert prec.autocast_dtype == torch.bfloat16 and not prec.use_scaler
    x = torch.randn(16, 3, 16, 16)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    losses = []
    for _ in range(15):
        st = train_step(model, opt, None, [(x[:8], y[:8]), (x[8:], y[8:])], 16, precision=prec, grad_clip_norm=1.0)
        losses.append(float(st.loss_sum) / 16)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_image_folder_samples_never_reseed_torch_global_generators(tmp_path, monkeypatch):
    write_folder(tmp_path)
    ds = SeededImageFolder(str(tmp_path), image_transforms(16, train=True, augment=True), seed=3)
    expected = ds[4][0]

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.manual_seed called while loading a sample (reseeds every CUDA generator)")

    monkeypatch.setattr(torch, "manual_seed", forbidden)
    monkeypatch.setattr(torch.random, "manual_seed", forbidden)
    before = torch.get_rng_state()
    x, _label = ds[4]
    assert torch.equal(x, expected) and x.shape == (3, 16, 16)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is neither used nor moved


def test_image_folder_augmentation_varies_over_samples_and_keeps_the_crop_inside_the_image(tmp_path):
    write_folder(tmp_path, n=12)
    ds = SeededImageFolder(str(tmp_path), image_transforms(8, train=True, augment=True), seed=0)
    views = {ds[i % 2][0].sum().item() for i in range(2)} | {ds[1][0].sum().item()}
    ds.set_epoch(3)
    views |= {ds[1][0].sum().item()}
    assert len(views) >= 2
    crop = image_transforms(8, train=True, augment=True)
    for k in range(200):
        top, left, h, w = crop.crop_box(20, 10, torch.Generator().manual_seed(k))
        assert 0 < h <= 10 and 0 < w <= 20 and top + h <= 10 and left + w <= 20
    val = SeededImageFolder(str(tmp_path), image_transforms(8, train=False, augment=False), seed=0)
    assert torch.equal(val[3][0], val[3][0]) and val[3][0].shape == (3, 8, 8)
