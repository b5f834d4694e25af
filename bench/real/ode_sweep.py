"""An integrator over many parameter sets: ``scipy.integrate.solve_ivp``, a sweep.

A forced, damped pendulum integrated for 30 s of its time (RK45) once
per (damping, forcing) pair of a grid, with ``ex.map``; each call returns the final state
and the number of right-hand-side evaluations. Small arguments, calls of tens of ms.
"""

import itertools
import math

import numpy as np
from scipy.integrate import solve_ivp


def pendulum(t, state, damping, forcing):
    theta, omega = state
    return [omega, -damping * omega - math.sin(theta) + forcing * math.cos(0.667 * t)]


def simulate(params):
    damping, forcing = params
    sol = solve_ivp(
        pendulum,
        (0.0, 30.0),
        [0.2, 0.0],
        args=(damping, forcing),
        rtol=1e-6,
        atol=1e-8,
    )
    theta, omega = sol.y[:, -1]
    return round(float(theta), 6), round(float(omega), 6), int(sol.nfev)


def main(Executor, scale=1.0):
    side = max(2, round(12 * math.sqrt(scale)))
    grid = list(
        itertools.product(
            np.linspace(0.05, 0.5, side).tolist(), np.linspace(0.5, 1.5, side).tolist()
        )
    )
    with Executor(2) as ex:
        finals = list(ex.map(simulate, grid))
    return {
        "runs": len(finals),
        "evaluations": sum(n for _, _, n in finals),
        "mean_theta": round(sum(t for t, _, _ in finals) / len(finals), 4),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
