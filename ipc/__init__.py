"""Inter-process plumbing: credit-flow core, shared-memory rings, pipe tokens.

Imports only the standard library and posix_ipc.
"""
