"""Versioned ClickHouse DDL of the ledger (data files; see kvmeter.ledger.schema)."""
