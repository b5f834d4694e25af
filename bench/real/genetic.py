"""A genetic algorithm whose fitness function reads 800 KB of module-level data.

A travelling-salesman tour evolved over generations: the distance matrix of 320 cities
(320 x 320 float64, 800 KiB) is a module-level global that the fitness function reads,
as a toolbox's ``evaluate`` does. Each generation maps the fitness over the population
(``ex.map``), then selects, crosses and mutates in the parent with a seeded generator:
many short calls, in rounds that wait for each other.
"""

import numpy as np

CITIES = 320
_rng = np.random.default_rng(42)
_xy = _rng.random((CITIES, 2))
DISTANCES = np.sqrt(((_xy[:, None, :] - _xy[None, :, :]) ** 2).sum(-1))


def tour_length(tour):
    return float(DISTANCES[tour, np.roll(tour, -1)].sum())


def crossover(rng, a, b):
    lo, hi = sorted(rng.choice(CITIES, 2, replace=False).tolist())
    middle = a[lo:hi]
    rest = b[~np.isin(b, middle)]
    return np.concatenate([rest[:lo], middle, rest[lo:]])


def mutate(rng, tour):
    i, j = sorted(rng.choice(CITIES, 2, replace=False).tolist())
    tour = tour.copy()
    tour[i:j] = tour[i:j][::-1]
    return tour


def main(Executor, scale=1.0):
    rng = np.random.default_rng(7)
    population = [rng.permutation(CITIES) for _ in range(64)]
    generations = max(2, round(40 * scale))
    best = []
    with Executor(2) as ex:
        for _ in range(generations):
            fitness = np.array(list(ex.map(tour_length, population)))
            order = np.argsort(fitness, kind="stable")
            best.append(float(fitness[order[0]]))
            parents = [population[i] for i in order[:16]]
            children = []
            while len(children) < len(population) - len(parents):
                a, b = rng.choice(len(parents), 2, replace=False)
                children.append(mutate(rng, crossover(rng, parents[a], parents[b])))
            population = parents + children
    return {
        "generations": generations,
        "first": round(best[0], 9),
        "best": round(min(best), 9),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
