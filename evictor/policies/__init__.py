"""The eviction policies and their registry (`python -m evictor.policies` lists them).

Every public module of this package defines some policies (`scoring.policy.Policy` subclasses) with
``@register_policy("name")``; `POLICIES` imports them all the first time it is read, so adding a policy is adding a
module (or a class to one) and nothing else. Policies are listed by module name, then in definition order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scoring.registry import Registry

if TYPE_CHECKING:  # the policies import torch when the registry is first read, not before (`--help` needs neither)
    from scoring.policy import Policy

POLICIES: Registry[Policy] = Registry("policy", __name__)
register_policy = POLICIES.register
get_policy = POLICIES.create  # an instance by name; an unknown name is a UsageError with a did-you-mean hint
policy_names = POLICIES.names
