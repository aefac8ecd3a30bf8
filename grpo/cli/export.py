"""`python -m grpo.cli.export CHECKPOINT OUT_DIR [--adapter]`: a saved checkpoint as a Hugging Face folder
or a PEFT adapter (the library: grpo/infra/export.py)."""
import sys

from grpo.infra.export import main

if __name__ == "__main__":
    main(sys.argv[1:])
