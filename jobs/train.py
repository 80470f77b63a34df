"""The main entrypoint, locally and under `ray job submit`:  python jobs/train.py [Hydra overrides]"""

import sys

import hydra
from omegaconf import DictConfig

import distrain.config  # noqa: F401  (registers the config schemas with Hydra)
from distrain.cli import check_group_choices, plan_overrides, run


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    sys.argv[1:] = plan_overrides(sys.argv[1:])
    check_group_choices(sys.argv[1:])
    main()
