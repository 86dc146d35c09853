"""Gradient averaging: the averagers geotrain uses, PowerSGD, and how a round ended or was given up."""
