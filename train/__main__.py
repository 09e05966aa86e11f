"""`python -m train [flags]`: see `train.cli`."""

from train.cli import main

if __name__ == "__main__":
  main()
