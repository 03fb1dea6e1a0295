"""What every service stands on: settings, logs, the NATS bus, subjects, health, wire types."""
