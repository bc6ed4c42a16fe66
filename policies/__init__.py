"""Admission policies: small pure objects that never read the clock or import the server."""
