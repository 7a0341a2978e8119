"""The broker pipeline (reader, channel, queue, store), its supervisor, load generator and CLI."""
