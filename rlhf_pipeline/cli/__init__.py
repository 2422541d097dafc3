"""The ``rlhf-pipeline`` command. Command modules import torch only inside ``run``."""
