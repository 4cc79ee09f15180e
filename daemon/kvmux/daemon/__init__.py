"""kvmux.daemon: the service that multiplexes decode sessions (engine, model folders)."""
