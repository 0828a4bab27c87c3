"""The plan: each step's key and status before any heavy work, and the checks that refuse a spec early."""
