"""Core library: params, layers, optimizers, schedules, devices."""
