"""geotrain: train one deep learning model on cheap spot VMs spread over clouds and continents.

Importing this package is cheap on purpose (the planner must start instantly): the trainer,
the coordinator and the tasks import torch and hivemind themselves when they run.
"""

__version__ = "0.1.0"
