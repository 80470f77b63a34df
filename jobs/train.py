"""The main entrypoint, locally and under `ray job submit`:  python jobs/train.py [Hydra overrides]"""

from distrain.cli import main

if __name__ == "__main__":
    main()
