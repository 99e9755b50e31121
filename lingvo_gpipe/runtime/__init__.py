"""The parallel runtime: where cells run and how the processes around them are managed.

  devices.py        local devices: logical CPUs, GPUs, one GPU split (--devices)
  cluster.py        cluster specs, joining TensorFlow servers, worker status calls
  watchdog.py       the trainer's watch over its workers (dead, frozen, unreachable)
  local_workers.py  loopback tools/worker.py processes (tests, benchmarks)
  memory_log.py     a worker's device memory as JSON lines
"""
