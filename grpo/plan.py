"""`python -m grpo.plan RECIPE --gpus N --gpu NAME`: a recipe's memory per rank, phase by phase, before
anything loads (the arithmetic is grpo/memory.py; the command line, which loads recipe files, grpo/cli/plan.py)."""
import sys

if __name__ == "__main__":
    from grpo.cli.plan import main
    main(sys.argv[1:])
