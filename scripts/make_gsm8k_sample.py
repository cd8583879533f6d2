# ruff: noqa: E501  (each problem's text stays on one line)
"""Writes grade-school math problems made up from templates, in GSM8K's format (``question``; ``answer`` with one step
per line, calculator annotations ``<<6*10=60>>`` and a last line ``#### 30``). Every annotation is evaluated and
checked.

    python scripts/make_gsm8k_sample.py                  # examples/data/gsm8k-{train,test}.jsonl: 48 and 16 rows
    python scripts/make_gsm8k_sample.py --name smollm2-gsm8k --train 4000 --test 200 --max-steps 1

``--max-steps`` keeps the templates whose solutions take at most that many steps (one line each): the difficulty a
small model can learn from. Each step count is drawn equally often. No held-out question is also a training one."""

import argparse
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


def calc(expr):
    value = eval(expr)
    if isinstance(value, float):
        assert value == int(value), (expr, value)
        value = int(value)
    return value


def line(text, expr):
    """text with {} where the annotated calculation goes."""
    v = calc(expr)
    return text.format(f"{expr} = <<{expr}={v}>>{v}"), v


NAMES = [
    "Maya",
    "Tom",
    "Priya",
    "Leo",
    "Amara",
    "Jonas",
    "Sofia",
    "Ravi",
    "Elena",
    "Kofi",
    "Hana",
    "Diego",
    "Nadia",
    "Owen",
    "Lucia",
    "Sam",
]


def t_more(r, n):
    a, b = r.randint(3, 40), r.randint(2, 30)
    thing = r.choice(["apples", "stickers", "marbles", "books", "shells", "stamps"])
    q = f"{n} has {a} {thing}. {n} gets {b} more {thing}. How many {thing} does {n} have now?"
    l1, total = line(f"{n} has {{}} {thing}.", f"{a}+{b}")
    return q, [l1], total


def t_give(r, n):
    a = r.randint(12, 60)
    b = r.randint(2, a - 3)
    thing = r.choice(["candies", "pencils", "cards", "balloons", "coins"])
    q = f"{n} has {a} {thing} and gives {b} of them to a friend. How many {thing} does {n} have left?"
    l1, left = line(f"{n} has {{}} {thing} left.", f"{a}-{b}")
    return q, [l1], left


def t_boxes(r, n):
    boxes, per = r.randint(2, 9), r.randint(3, 12)
    thing = r.choice(["crayons", "eggs", "cupcakes", "toy cars", "oranges"])
    q = f"{n} has {boxes} boxes with {per} {thing} in each box. How many {thing} does {n} have?"
    l1, total = line(f"{n} has {{}} {thing}.", f"{boxes}*{per}")
    return q, [l1], total


def t_share(r, n):
    people, each = r.randint(2, 8), r.randint(2, 9)
    thing = r.choice(["cookies", "grapes", "strawberries", "nuts"])
    q = f"{n} shares {people * each} {thing} equally among {people} friends. How many {thing} does each friend get?"
    l1, got = line("Each friend gets {} " + thing + ".", f"{people * each}/{people}")
    return q, [l1], got


def t_bakery(r, n):
    a, b, c = r.randint(3, 9), r.randint(2, 6), r.randint(2, 5)
    q = f"{n} bakes {a} trays of muffins with {b * 2} muffins on each tray. {n} gives {c} muffins to each of {a} neighbors and keeps the rest. How many muffins does {n} keep?"
    l1, total = line(f"{n} bakes {{}} muffins.", f"{a}*{b * 2}")
    l2, sold = line(f"{n} gives away {{}} muffins.", f"{c}*{a}")
    l3, kept = line(f"{n} keeps {{}} muffins.", f"{total}-{sold}")
    return q, [l1, l2, l3], kept


def t_savings(r, n):
    w, s, price = r.randint(4, 12), r.randint(5, 15), 0
    price = w * s + r.randint(10, 40)
    q = f"{n} saves ${s} every week for {w} weeks to buy a bike that costs ${price}. How much more money does {n} need?"
    l1, saved = line(f"In {w} weeks {n} saves ${{}}.", f"{s}*{w}")
    l2, more = line(f"{n} needs ${{}} more.", f"{price}-{saved}")
    return q, [l1, l2], more


def t_speed(r, n):
    v, h1, h2 = r.choice([40, 45, 50, 55, 60, 65]), r.randint(2, 4), r.randint(1, 3)
    q = f"A train travels at {v} miles per hour. It travels for {h1} hours, stops for lunch, and then travels for {h2} more hours at the same speed. How many miles does it travel in total?"
    l1, hours = line("It travels for {} hours.", f"{h1}+{h2}")
    l2, miles = line("It travels {} miles.", f"{v}*{hours}")
    return q, [l1, l2], miles


def t_percent(r, n):
    price, off = r.choice([40, 60, 80, 120, 150, 200, 240]), r.choice([10, 20, 25, 50])
    k = r.randint(2, 4)
    q = f"A jacket costs ${price}. During a sale it is {off}% off. {n} buys {k} jackets at the sale price. How much does {n} pay?"
    l1, disc = line("The discount is ${}.", f"{price}*{off}/100")
    l2, sale = line("The sale price is ${}.", f"{price}-{disc}")
    l3, pay = line(f"{n} pays ${{}}.", f"{sale}*{k}")
    return q, [l1, l2, l3], pay


def t_ages(r, n):
    a, d, y = r.randint(6, 14), r.randint(20, 30), r.randint(3, 10)
    q = f"{n} is {a} years old. {n}'s mother is {d} years older than {n}. How old will {n}'s mother be in {y} years?"
    l1, m = line(f"{n}'s mother is {{}} years old now.", f"{a}+{d}")
    l2, later = line("In " + str(y) + " years she will be {} years old.", f"{m}+{y}")
    return q, [l1, l2], later


def t_garden(r, n):
    rows, per, dead = r.randint(4, 9), r.randint(6, 12), r.randint(3, 10)
    q = f"{n} plants {rows} rows of tomato plants with {per} plants in each row. {dead} plants die in a storm. Each remaining plant gives 3 tomatoes. How many tomatoes does {n} pick?"
    l1, plants = line("There are {} plants.", f"{rows}*{per}")
    l2, left = line("After the storm {} plants are left.", f"{plants}-{dead}")
    l3, tom = line(f"{n} picks {{}} tomatoes.", f"{left}*3")
    return q, [l1, l2, l3], tom


def t_fraction(r, n):
    total = r.choice([24, 36, 48, 60, 72, 84, 96])
    q = f"A class has {total} students. One third of them walk to school, one quarter ride bikes, and the rest take the bus. How many students take the bus?"
    l1, walk = line("{} students walk.", f"{total}/3")
    l2, bike = line("{} students ride bikes.", f"{total}/4")
    l3, bus = line("{} students take the bus.", f"{total}-{walk}-{bike}")
    return q, [l1, l2, l3], bus


def t_pages(r, n):
    book, d1, days = r.choice([180, 240, 300, 360, 420]), r.randint(15, 30), r.randint(3, 6)
    q = f"{n}'s book has {book} pages. {n} reads {d1} pages a day for {days} days. How many pages are left to read?"
    l1, read = line(f"{n} reads {{}} pages.", f"{d1}*{days}")
    l2, left = line("There are {} pages left.", f"{book}-{read}")
    return q, [l1, l2], left


def t_wage(r, n):
    rate, h, extra = r.randint(12, 25), r.randint(20, 40), r.randint(2, 8)
    q = f"{n} earns ${rate} an hour. This week {n} worked {h} regular hours and {extra} overtime hours, which pay twice the hourly rate. How much did {n} earn this week?"
    l1, reg = line("Regular hours pay ${}.", f"{rate}*{h}")
    l2, ot_rate = line("Overtime pays ${} an hour.", f"{rate}*2")
    l3, ot = line("Overtime hours pay ${}.", f"{ot_rate}*{extra}")
    l4, total = line(f"{n} earned ${{}}.", f"{reg}+{ot}")
    return q, [l1, l2, l3, l4], total


def t_pizza(r, n):
    pizzas, slices, people = r.randint(3, 7), 8, r.randint(5, 9)
    each = r.randint(2, 3)
    q = f"{n} orders {pizzas} pizzas cut into {slices} slices each for a party of {people} people. Each person eats {each} slices. How many slices are left over?"
    l1, total = line("There are {} slices.", f"{pizzas}*{slices}")
    l2, eaten = line("The guests eat {} slices.", f"{people}*{each}")
    l3, left = line("{} slices are left over.", f"{total}-{eaten}")
    return q, [l1, l2, l3], left


def t_water(r, n):
    cap, rate, used = r.choice([200, 300, 400, 500]), r.randint(10, 25), r.randint(20, 60)
    q = f"A tank holds {cap} liters. It is filled at {rate} liters per minute for 8 minutes, starting empty, and then {used} liters are used to water the lawn. How many more liters are needed to fill the tank?"
    l1, filled = line("The tank gets {} liters.", f"{rate}*8")
    l2, now = line("After watering it holds {} liters.", f"{filled}-{used}")
    l3, more = line("It needs {} more liters.", f"{cap}-{now}")
    return q, [l1, l2, l3], more


def t_shop(r, n):
    a, pa, b, pb, paid = r.randint(2, 6), r.randint(3, 9), r.randint(1, 4), r.randint(10, 20), 100
    q = f"{n} buys {a} notebooks at ${pa} each and {b} backpacks at ${pb} each. {n} pays with a ${paid} bill. How much change does {n} get?"
    l1, na = line("The notebooks cost ${}.", f"{a}*{pa}")
    l2, nb = line("The backpacks cost ${}.", f"{b}*{pb}")
    l3, change = line(f"{n} gets ${{}} in change.", f"{paid}-{na}-{nb}")
    return q, [l1, l2, l3], change


def t_farm(r, n):
    cows, chickens = r.randint(5, 20), r.randint(10, 40)
    q = f"A farm has {cows} cows and {chickens} chickens. How many legs do the animals on the farm have in total?"
    l1, cl = line("The cows have {} legs.", f"{cows}*4")
    l2, hl = line("The chickens have {} legs.", f"{chickens}*2")
    l3, total = line("Together they have {} legs.", f"{cl}+{hl}")
    return q, [l1, l2, l3], total


def t_commute(r, n):
    minutes, days, weeks = r.choice([25, 30, 35, 40, 45]), 5, r.randint(3, 8)
    q = f"{n} spends {minutes} minutes driving to work and the same time driving home, {days} days a week. How many hours does {n} spend driving in {weeks} weeks?"
    l1, day = line("Each day takes {} minutes.", f"{minutes}*2")
    l2, week = line("Each week takes {} minutes.", f"{day}*{days}")
    l3, mins = line(f"In {weeks} weeks that is {{}} minutes.", f"{week}*{weeks}")
    if mins % 60:
        return None
    l4, hours = line("That is {} hours.", f"{mins}/60")
    return q, [l1, l2, l3, l4], hours


def t_cookies(r, n):
    batches, per, boxes = r.randint(3, 8), r.choice([12, 18, 24, 30]), r.choice([6, 4, 3])
    q = f"{n} bakes {batches} batches of cookies with {per} cookies in each batch and packs them into boxes of {boxes}. Each box sells for $5. How much money does {n} make if every box is sold?"
    l1, total = line("There are {} cookies.", f"{batches}*{per}")
    if total % boxes:
        return None
    l2, nbox = line("That fills {} boxes.", f"{total}/{boxes}")
    l3, money = line(f"{n} makes ${{}}.", f"{nbox}*5")
    return q, [l1, l2, l3], money


def t_rent(r, n):
    rent, months, share = r.choice([1200, 1500, 1800, 2100, 2400]), 12, r.choice([2, 3, 4])
    q = f"{n} shares an apartment with {share - 1} friends. The rent is ${rent} a month and they split it evenly. How much rent does {n} pay in a year?"
    l1, each = line(f"{n} pays ${{}} a month.", f"{rent}/{share}")
    l2, year = line(f"In a year {n} pays ${{}}.", f"{each}*{months}")
    return q, [l1, l2], year


ONE_STEP = [t_more, t_give, t_boxes, t_share]
"""Templates of one step, for the smallest models (the 48-row sample keeps the multi-step ones below)."""
TEMPLATES = [
    t_bakery,
    t_savings,
    t_speed,
    t_percent,
    t_ages,
    t_garden,
    t_fraction,
    t_pages,
    t_wage,
    t_pizza,
    t_water,
    t_shop,
    t_farm,
    t_commute,
    t_cookies,
    t_rent,
]


def steps_of(template) -> int:
    """How many steps (solution lines) a template's problems take."""
    made = None
    seed = 0
    while made is None:
        made = template(random.Random(seed), "Sam")
        seed += 1
    return len(made[1])


def rows(seed, count, templates=TEMPLATES, exclude=frozenset()):
    """``count`` problems: the templates by turns, except that with templates of several step counts each count is
    drawn equally often (a template of that count at random); none whose question is in ``exclude``."""
    r = random.Random(seed)
    by_steps = {}
    for template in templates:
        by_steps.setdefault(steps_of(template), []).append(template)
    counts = sorted(by_steps)
    out = []
    while len(out) < count:
        if len(counts) == 1 or templates is TEMPLATES:
            template = templates[len(out) % len(templates)]
        else:
            template = r.choice(by_steps[counts[len(out) % len(counts)]])
        made = template(r, r.choice(NAMES))
        if made is None:
            continue
        q, lines, answer = made
        if not (isinstance(answer, int) and answer > 0) or q in exclude:
            continue
        for text in lines:  # check every annotation
            for expr, value in re.findall(r"<<([^=]+)=(-?\d+)>>", text):
                assert calc(expr) == int(value), text
        out.append({"question": q, "answer": "\n".join(lines) + f"\n#### {answer}"})
    return out


def write(path, data):
    Path(path).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in data))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="gsm8k", help="files examples/data/NAME-{train,test}.jsonl")
    parser.add_argument("--train", type=int, default=48, help="training rows")
    parser.add_argument("--test", type=int, default=16, help="held-out rows (another seed)")
    parser.add_argument("--max-steps", type=int, default=None, help="only templates of at most this many steps")
    args = parser.parse_args(argv)
    templates = TEMPLATES
    if args.max_steps is not None:
        templates = [t for t in ONE_STEP + TEMPLATES if steps_of(t) <= args.max_steps]
        if not templates:
            parser.error(f"no template takes at most {args.max_steps} steps")
    train = rows(1, args.train, templates)
    write(DATA / f"{args.name}-train.jsonl", train)
    write(DATA / f"{args.name}-test.jsonl", rows(2, args.test, templates, {row["question"] for row in train}))


if __name__ == "__main__":
    main()
