"""Test-mode sandbox runner for AI-agent workflow steps."""
