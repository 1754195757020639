"""Dispatch: plans turned into ledger entries and task messages (chains), and the reconciler
that publishes again what is overdue with nobody on it (reconcile, redrive)."""
