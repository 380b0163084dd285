"""configs/base.yaml against the config's dataclasses: every key, with its default."""

import dataclasses

from shmserve import config


def test_base_yaml_lists_every_key_with_its_default():
    """It says it lists "every key shmserve knows" (a model's `instruction` was missing: an
    outside check); a model's `variants` and `sticky_key`, which replace `source`, in comments."""
    import yaml

    base = yaml.safe_load((config.REPO_ROOT / "configs" / "base.yaml").read_text())
    fields = {f.name: f for f in dataclasses.fields(config.Config)}
    assert set(base) == set(fields)
    defaults = config.Config(models=[])
    for name, section in base.items():
        if isinstance(section, dict):
            assert section == dataclasses.asdict(getattr(defaults, name)), name
    model, = base["models"]
    known = {f.name for f in dataclasses.fields(config.ModelConfig)}
    assert set(model) == known - {"variants", "sticky_key"}
    text = (config.REPO_ROOT / "configs" / "base.yaml").read_text()
    assert "# variants: [" in text and "# sticky_key: " in text
