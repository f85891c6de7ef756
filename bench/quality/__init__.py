"""Drafter quality on the practice target: real tau against prompt lookup, the scaling curve, paired comparisons."""
