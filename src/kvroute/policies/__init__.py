"""Routing policies (pure): the :class:`Policy` protocol, the policies, and the name registry."""

from kvroute.policies.base import Policy
from kvroute.policies.registry import DEFAULT_POLICY, POLICIES, make_policy, policy_names

__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "make_policy", "policy_names"]
