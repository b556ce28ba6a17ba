"""Write the sample Search-R1 data: a small factual corpus and questions answerable from it.

    python recipes/data/make_search_corpus.py [--out recipes/data]

- `search_corpus.jsonl`: a few hundred short passages, `{"id": str, "contents": "title\\ntext"}`
  (countries, capitals, elements, planets, books, plays, paintings, discoveries, composers,
  places, people, events, nature), written from the tables below. Serve it with
  `python -m rl2.tools.retrieval_server --corpus recipes/data/search_corpus.jsonl`.
- `search_qa.jsonl`: RL rows `{"messages": [{"role": "user", "content": <Search-R1 prompt +
  question>}], "answer": [gold answers]}` for `envs/search.py`; a few need two searches.

The output is deterministic (no randomness); the script checks that every question's first gold
answer occurs in the corpus.
"""

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ENV_FILE = os.path.join(REPO, "envs", "search.py")

# name, capital, continent, currency, main language(s)
COUNTRIES = [
    ("France", "Paris", "Europe", "the euro", "French"),
    ("Germany", "Berlin", "Europe", "the euro", "German"),
    ("Italy", "Rome", "Europe", "the euro", "Italian"),
    ("Spain", "Madrid", "Europe", "the euro", "Spanish"),
    ("Portugal", "Lisbon", "Europe", "the euro", "Portuguese"),
    ("Netherlands", "Amsterdam", "Europe", "the euro", "Dutch"),
    ("Belgium", "Brussels", "Europe", "the euro", "Dutch, French and German"),
    ("Switzerland", "Bern", "Europe", "the Swiss franc", "German, French, Italian and Romansh"),
    ("Austria", "Vienna", "Europe", "the euro", "German"),
    ("Poland", "Warsaw", "Europe", "the zloty", "Polish"),
    ("Sweden", "Stockholm", "Europe", "the Swedish krona", "Swedish"),
    ("Norway", "Oslo", "Europe", "the Norwegian krone", "Norwegian"),
    ("Denmark", "Copenhagen", "Europe", "the Danish krone", "Danish"),
    ("Finland", "Helsinki", "Europe", "the euro", "Finnish and Swedish"),
    ("Ireland", "Dublin", "Europe", "the euro", "Irish and English"),
    ("United Kingdom", "London", "Europe", "the pound sterling", "English"),
    ("Greece", "Athens", "Europe", "the euro", "Greek"),
    ("Hungary", "Budapest", "Europe", "the forint", "Hungarian"),
    ("Czech Republic", "Prague", "Europe", "the Czech koruna", "Czech"),
    ("Iceland", "Reykjavik", "Europe", "the Icelandic krona", "Icelandic"),
    ("Ukraine", "Kyiv", "Europe", "the hryvnia", "Ukrainian"),
    ("Russia", "Moscow", "Europe and Asia", "the Russian ruble", "Russian"),
    ("Turkey", "Ankara", "Asia and Europe", "the Turkish lira", "Turkish"),
    ("Egypt", "Cairo", "Africa", "the Egyptian pound", "Arabic"),
    ("Nigeria", "Abuja", "Africa", "the naira", "English"),
    ("Kenya", "Nairobi", "Africa", "the Kenyan shilling", "Swahili and English"),
    ("Ethiopia", "Addis Ababa", "Africa", "the birr", "Amharic and Oromo"),
    ("Morocco", "Rabat", "Africa", "the Moroccan dirham", "Arabic and Berber"),
    ("Ghana", "Accra", "Africa", "the cedi", "English"),
    ("China", "Beijing", "Asia", "the renminbi (yuan)", "Mandarin Chinese"),
    ("Japan", "Tokyo", "Asia", "the yen", "Japanese"),
    ("India", "New Delhi", "Asia", "the Indian rupee", "Hindi and English"),
    ("South Korea", "Seoul", "Asia", "the South Korean won", "Korean"),
    ("Thailand", "Bangkok", "Asia", "the baht", "Thai"),
    ("Vietnam", "Hanoi", "Asia", "the dong", "Vietnamese"),
    ("Pakistan", "Islamabad", "Asia", "the Pakistani rupee", "Urdu and English"),
    ("Saudi Arabia", "Riyadh", "Asia", "the Saudi riyal", "Arabic"),
    ("Iran", "Tehran", "Asia", "the Iranian rial", "Persian"),
    ("Philippines", "Manila", "Asia", "the Philippine peso", "Filipino and English"),
    ("Australia", "Canberra", "Oceania", "the Australian dollar", "English"),
    ("New Zealand", "Wellington", "Oceania", "the New Zealand dollar", "English and Maori"),
    ("Canada", "Ottawa", "North America", "the Canadian dollar", "English and French"),
    ("Mexico", "Mexico City", "North America", "the Mexican peso", "Spanish"),
    ("Cuba", "Havana", "North America", "the Cuban peso", "Spanish"),
    ("Brazil", "Brasilia", "South America", "the Brazilian real", "Portuguese"),
    ("Argentina", "Buenos Aires", "South America", "the Argentine peso", "Spanish"),
    ("Chile", "Santiago", "South America", "the Chilean peso", "Spanish"),
    ("Peru", "Lima", "South America", "the Peruvian sol", "Spanish, Quechua and Aymara"),
    ("Colombia", "Bogota", "South America", "the Colombian peso", "Spanish"),
]

PLURAL_OR_UNION = {"Netherlands", "United Kingdom", "Czech Republic", "Philippines"}  # take "the"

# name, symbol, atomic number, a further fact
ELEMENTS = [
    ("Hydrogen", "H", 1, "It is the lightest and most abundant element in the universe."),
    ("Helium", "He", 2, "It is a noble gas used to fill balloons."),
    ("Lithium", "Li", 3, "It is the lightest metal and is used in rechargeable batteries."),
    ("Beryllium", "Be", 4, "It is a light alkaline earth metal."),
    ("Boron", "B", 5, "It is a metalloid used in borosilicate glass."),
    ("Carbon", "C", 6, "Diamond and graphite are both forms of carbon."),
    ("Nitrogen", "N", 7, "Nitrogen makes up about 78 percent of Earth's atmosphere."),
    ("Oxygen", "O", 8, "Oxygen makes up about 21 percent of Earth's atmosphere."),
    ("Fluorine", "F", 9, "It is the most reactive of all the elements."),
    ("Neon", "Ne", 10, "It is a noble gas that glows red-orange in neon signs."),
    ("Sodium", "Na", 11, "It is a soft alkali metal; table salt is sodium chloride."),
    ("Magnesium", "Mg", 12, "It is a light metal that burns with a bright white flame."),
    ("Aluminium", "Al", 13, "It is the most abundant metal in Earth's crust."),
    ("Silicon", "Si", 14, "It is a semiconductor used to make computer chips."),
    ("Phosphorus", "P", 15, "White phosphorus glows in the dark."),
    ("Sulfur", "S", 16, "It is a yellow nonmetal."),
    ("Chlorine", "Cl", 17, "It is a yellow-green gas used to disinfect water."),
    ("Argon", "Ar", 18, "It is the most common noble gas in Earth's atmosphere."),
    ("Potassium", "K", 19, "It is an alkali metal; its symbol comes from the Latin kalium."),
    ("Calcium", "Ca", 20, "Bones and teeth contain calcium."),
    ("Titanium", "Ti", 22, "It is a strong, light metal that resists corrosion."),
    ("Chromium", "Cr", 24, "It is used for chrome plating and stainless steel."),
    ("Manganese", "Mn", 25, "It is used in steel making."),
    ("Iron", "Fe", 26, "It is the main component of steel; its symbol comes from the Latin ferrum."),
    ("Cobalt", "Co", 27, "It gives cobalt blue pigment its colour."),
    ("Nickel", "Ni", 28, "It is a silvery metal used in coins and stainless steel."),
    ("Copper", "Cu", 29, "It is a reddish metal that conducts electricity well."),
    ("Zinc", "Zn", 30, "It is used to galvanise steel against rust."),
    ("Silver", "Ag", 47, "It has the highest electrical conductivity of any element; its symbol comes from the Latin argentum."),
    ("Tin", "Sn", 50, "Bronze is an alloy of copper and tin."),
    ("Iodine", "I", 53, "It is a halogen needed by the thyroid gland."),
    ("Xenon", "Xe", 54, "It is a heavy noble gas."),
    ("Tungsten", "W", 74, "It has the highest melting point of all metals."),
    ("Platinum", "Pt", 78, "It is a precious metal used in catalytic converters."),
    ("Gold", "Au", 79, "It is a precious yellow metal; its symbol comes from the Latin aurum."),
    ("Mercury (element)", "Hg", 80, "It is the only metal that is liquid at room temperature."),
    ("Lead", "Pb", 82, "It is a dense, soft metal; its symbol comes from the Latin plumbum."),
    ("Radon", "Rn", 86, "It is a radioactive noble gas."),
    ("Radium", "Ra", 88, "It was discovered by Marie and Pierre Curie in 1898."),
    ("Uranium", "U", 92, "It is used as fuel in nuclear power plants."),
]

# title, text
PLANETS = [
    ("Mercury (planet)", "Mercury is the smallest planet in the Solar System and the closest to the Sun."),
    ("Venus", "Venus is the second planet from the Sun and the hottest planet in the Solar System, because of its thick carbon dioxide atmosphere."),
    ("Earth", "Earth is the third planet from the Sun and the only known planet to support life. It has one natural satellite, the Moon."),
    ("Mars", "Mars is the fourth planet from the Sun. It is known as the Red Planet because of the iron oxide on its surface."),
    ("Jupiter", "Jupiter is the fifth planet from the Sun and the largest planet in the Solar System. Its Great Red Spot is a giant storm."),
    ("Saturn", "Saturn is the sixth planet from the Sun and is famous for its prominent ring system."),
    ("Uranus", "Uranus is the seventh planet from the Sun. It rotates on its side and was discovered by William Herschel in 1781."),
    ("Neptune", "Neptune is the eighth and farthest known planet from the Sun. It was discovered in 1846."),
]

# title, author, year of first publication (None: not given, e.g. first published in parts)
BOOKS = [
    ("Pride and Prejudice", "Jane Austen", 1813),
    ("Sense and Sensibility", "Jane Austen", 1811),
    ("Nineteen Eighty-Four", "George Orwell", 1949),
    ("Animal Farm", "George Orwell", 1945),
    ("To Kill a Mockingbird", "Harper Lee", 1960),
    ("The Great Gatsby", "F. Scott Fitzgerald", 1925),
    ("Moby-Dick", "Herman Melville", 1851),
    ("War and Peace", "Leo Tolstoy", None),
    ("Crime and Punishment", "Fyodor Dostoevsky", 1866),
    ("Don Quixote", "Miguel de Cervantes", 1605),
    ("Frankenstein", "Mary Shelley", 1818),
    ("Dracula", "Bram Stoker", 1897),
    ("Jane Eyre", "Charlotte Bronte", 1847),
    ("Wuthering Heights", "Emily Bronte", 1847),
    ("Great Expectations", "Charles Dickens", None),
    ("A Tale of Two Cities", "Charles Dickens", 1859),
    ("The Hobbit", "J. R. R. Tolkien", 1937),
    ("One Hundred Years of Solitude", "Gabriel Garcia Marquez", 1967),
    ("The Catcher in the Rye", "J. D. Salinger", 1951),
    ("Brave New World", "Aldous Huxley", 1932),
    ("Ulysses", "James Joyce", 1922),
    ("The Old Man and the Sea", "Ernest Hemingway", 1952),
    ("Les Miserables", "Victor Hugo", 1862),
    ("The Adventures of Tom Sawyer", "Mark Twain", 1876),
    ("Madame Bovary", "Gustave Flaubert", None),
    ("Fahrenheit 451", "Ray Bradbury", 1953),
    ("Lord of the Flies", "William Golding", 1954),
    ("Of Mice and Men", "John Steinbeck", 1937),
    ("The Grapes of Wrath", "John Steinbeck", 1939),
    ("Alice's Adventures in Wonderland", "Lewis Carroll", 1865),
    ("Treasure Island", "Robert Louis Stevenson", None),
    ("The Picture of Dorian Gray", "Oscar Wilde", None),
    ("The Divine Comedy", "Dante Alighieri", None),
    ("The Odyssey", "Homer", None),
]

PLAYS = ["Hamlet", "Macbeth", "Romeo and Juliet", "Othello", "King Lear"]  # tragedies by Shakespeare

# title, painter, where it is (None: not given)
PAINTINGS = [
    ("Mona Lisa", "Leonardo da Vinci", "kept in the Louvre in Paris"),
    ("The Last Supper", "Leonardo da Vinci", "painted on a wall of the convent of Santa Maria delle Grazie in Milan"),
    ("The Starry Night", "Vincent van Gogh", "kept in the Museum of Modern Art in New York"),
    ("The Night Watch", "Rembrandt", "kept in the Rijksmuseum in Amsterdam"),
    ("Girl with a Pearl Earring", "Johannes Vermeer", "kept in the Mauritshuis in The Hague"),
    ("The Persistence of Memory", "Salvador Dali", "kept in the Museum of Modern Art in New York"),
    ("Guernica", "Pablo Picasso", "kept in the Museo Reina Sofia in Madrid"),
    ("The Birth of Venus", "Sandro Botticelli", "kept in the Uffizi Gallery in Florence"),
    ("Las Meninas", "Diego Velazquez", "kept in the Prado Museum in Madrid"),
    ("The Garden of Earthly Delights", "Hieronymus Bosch", "kept in the Prado Museum in Madrid"),
    ("The Creation of Adam", "Michelangelo", "painted on the ceiling of the Sistine Chapel in Vatican City"),
    ("The Kiss", "Gustav Klimt", "kept in the Belvedere in Vienna"),
    ("American Gothic", "Grant Wood", "kept in the Art Institute of Chicago"),
    ("Nighthawks", "Edward Hopper", "kept in the Art Institute of Chicago"),
    ("Liberty Leading the People", "Eugene Delacroix", "kept in the Louvre in Paris"),
    ("Impression, Sunrise", "Claude Monet", "kept in the Musee Marmottan Monet in Paris"),
    ("The School of Athens", "Raphael", "painted on a wall of the Apostolic Palace in Vatican City"),
    ("The Arnolfini Portrait", "Jan van Eyck", "kept in the National Gallery in London"),
    ("The Scream", "Edvard Munch", None),
    ("The Great Wave off Kanagawa", "Katsushika Hokusai", None),
]

# title, text
DISCOVERIES = [
    ("Telephone", "Alexander Graham Bell was granted the first patent for the telephone in 1876."),
    ("Incandescent light bulb", "Thomas Edison developed a practical, long-lasting incandescent light bulb in 1879."),
    ("World Wide Web", "The World Wide Web was invented by Tim Berners-Lee at CERN in 1989."),
    ("Printing press", "Johannes Gutenberg introduced printing with movable metal type in Europe around 1440."),
    ("Dynamite", "Dynamite was invented by the Swedish chemist Alfred Nobel, who patented it in 1867. His fortune funded the Nobel Prizes."),
    ("Penicillin", "Penicillin, the first antibiotic, was discovered by Alexander Fleming in 1928."),
    ("Steam engine", "James Watt patented his improved steam engine with a separate condenser in 1769."),
    ("Airplane", "The Wright brothers, Orville and Wilbur Wright, made the first powered airplane flight in 1903 at Kitty Hawk, North Carolina."),
    ("Polio vaccine", "The first effective polio vaccine was developed by Jonas Salk and announced in 1955."),
    ("Periodic table", "Dmitri Mendeleev published the periodic table of the chemical elements in 1869."),
    ("Newton's laws of motion", "Isaac Newton set out his three laws of motion and the law of universal gravitation in the Principia, published in 1687."),
    ("Natural selection", "Charles Darwin described evolution by natural selection in On the Origin of Species, published in 1859."),
    ("DNA double helix", "The double helix structure of DNA was described by James Watson and Francis Crick in 1953."),
    ("Smallpox vaccine", "Edward Jenner developed the first vaccine, against smallpox, in 1796."),
    ("Electromagnetic induction", "Michael Faraday discovered electromagnetic induction in 1831."),
    ("X-rays", "X-rays were discovered by the German physicist Wilhelm Roentgen in 1895."),
    ("Special relativity", "Albert Einstein published the theory of special relativity in 1905."),
    ("Telescope", "Galileo Galilei built telescopes and used them to observe the moons of Jupiter in 1610."),
    ("Radioactivity", "Henri Becquerel discovered radioactivity in 1896."),
    ("Apollo 11", "Apollo 11 landed on the Moon in 1969; Neil Armstrong was the first person to walk on the Moon, followed by Buzz Aldrin."),
    ("Vostok 1", "Yuri Gagarin became the first person in space aboard Vostok 1 in 1961."),
]

# name, nationality, a famous work
COMPOSERS = [
    ("Ludwig van Beethoven", "German", "the Ninth Symphony, whose last movement sets the Ode to Joy"),
    ("Wolfgang Amadeus Mozart", "Austrian", "the opera The Magic Flute"),
    ("Johann Sebastian Bach", "German", "the Brandenburg Concertos"),
    ("Pyotr Ilyich Tchaikovsky", "Russian", "the ballet Swan Lake"),
    ("Frederic Chopin", "Polish", "his nocturnes for piano"),
    ("Antonio Vivaldi", "Italian", "the violin concertos The Four Seasons"),
    ("Giuseppe Verdi", "Italian", "the opera Aida"),
    ("Richard Wagner", "German", "the opera cycle The Ring of the Nibelung"),
    ("Claude Debussy", "French", "the piano piece Clair de lune"),
    ("George Frideric Handel", "German-British", "the oratorio Messiah"),
    ("Franz Schubert", "Austrian", "the Unfinished Symphony"),
    ("Giacomo Puccini", "Italian", "the opera Madama Butterfly"),
    ("Igor Stravinsky", "Russian", "the ballet The Rite of Spring"),
    ("Joseph Haydn", "Austrian", "more than a hundred symphonies, which earned him the name father of the symphony"),
]

# title, text
PLACES = [
    ("Mount Everest", "Mount Everest is the highest mountain on Earth, at 8,849 metres above sea level. It lies in the Himalayas on the border between Nepal and China."),
    ("K2", "K2 is the second-highest mountain on Earth. It lies in the Karakoram range on the border between Pakistan and China."),
    ("Mount Kilimanjaro", "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa."),
    ("Aconcagua", "Aconcagua, in the Andes of Argentina, is the highest mountain in the Americas."),
    ("Denali", "Denali, in Alaska, is the highest mountain in North America."),
    ("Mont Blanc", "Mont Blanc is the highest mountain in the Alps. It lies on the border between France and Italy."),
    ("Mount Fuji", "Mount Fuji is the highest mountain in Japan. It is an active volcano on the island of Honshu."),
    ("Nile", "The Nile is the longest river in Africa. It flows north through Egypt into the Mediterranean Sea."),
    ("Amazon River", "The Amazon River in South America carries more water than any other river. It flows into the Atlantic Ocean."),
    ("Danube", "The Danube flows through Vienna, Bratislava, Budapest and Belgrade before reaching the Black Sea."),
    ("River Thames", "The River Thames flows through London and into the North Sea."),
    ("Seine", "The Seine flows through Paris and into the English Channel."),
    ("Mississippi River", "The Mississippi River flows south through the United States into the Gulf of Mexico."),
    ("Yangtze", "The Yangtze is the longest river in Asia. It flows across China into the East China Sea at Shanghai."),
    ("Volga", "The Volga is the longest river in Europe. It flows through Russia into the Caspian Sea."),
    ("Rhine", "The Rhine rises in the Swiss Alps and flows through Germany and the Netherlands into the North Sea."),
    ("Ganges", "The Ganges flows across northern India and Bangladesh into the Bay of Bengal. It is sacred in Hinduism."),
    ("Lake Baikal", "Lake Baikal, in Siberia, Russia, is the deepest lake in the world."),
    ("Sahara", "The Sahara in North Africa is the largest hot desert in the world."),
    ("Pacific Ocean", "The Pacific Ocean is the largest and deepest of Earth's oceans."),
    ("Great Barrier Reef", "The Great Barrier Reef, off the coast of Queensland, Australia, is the world's largest coral reef system."),
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron tower in Paris, built by the company of Gustave Eiffel and completed in 1889."),
    ("Statue of Liberty", "The Statue of Liberty in New York Harbor was a gift from the people of France to the United States. It was dedicated in 1886."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across northern China over many centuries."),
    ("Colosseum", "The Colosseum is an ancient amphitheatre in the centre of Rome, Italy, completed in 80 AD."),
    ("Taj Mahal", "The Taj Mahal is a white marble mausoleum in Agra, India, built by the Mughal emperor Shah Jahan in memory of his wife Mumtaz Mahal."),
    ("Machu Picchu", "Machu Picchu is a 15th-century Inca citadel high in the Andes mountains of Peru."),
    ("Big Ben", "Big Ben is the nickname of the Great Bell of the clock at the north end of the Palace of Westminster in London."),
    ("Sydney Opera House", "The Sydney Opera House in Sydney, Australia, was designed by the Danish architect Jorn Utzon and opened in 1973."),
    ("Parthenon", "The Parthenon is a temple dedicated to the goddess Athena on the Acropolis of Athens, Greece."),
    ("Petra", "Petra is an ancient city in southern Jordan, famous for buildings carved into rose-coloured rock."),
    ("Stonehenge", "Stonehenge is a prehistoric monument of standing stones in Wiltshire, England."),
    ("Christ the Redeemer", "Christ the Redeemer is a large statue of Jesus overlooking Rio de Janeiro, Brazil, completed in 1931."),
]

# title, text
PEOPLE = [
    ("Albert Einstein", "Albert Einstein was a theoretical physicist born in Ulm, Germany, in 1879. He received the 1921 Nobel Prize in Physics."),
    ("Isaac Newton", "Isaac Newton was an English mathematician and physicist who formulated the laws of motion and universal gravitation."),
    ("Marie Curie", "Marie Curie was a Polish-born French physicist and chemist. She was the first woman to win a Nobel Prize and won Nobel Prizes in both physics and chemistry."),
    ("Charles Darwin", "Charles Darwin was an English naturalist known for the theory of evolution by natural selection. He sailed on HMS Beagle."),
    ("Galileo Galilei", "Galileo Galilei was an Italian astronomer and physicist who supported the idea that the Earth moves around the Sun."),
    ("Nikola Tesla", "Nikola Tesla was a Serbian-American inventor known for his work on alternating current electricity."),
    ("Ada Lovelace", "Ada Lovelace was an English mathematician who wrote what is considered the first computer program, for Charles Babbage's Analytical Engine."),
    ("Alan Turing", "Alan Turing was an English mathematician and computer scientist. He described the Turing machine and broke German codes at Bletchley Park."),
    ("Leonardo da Vinci", "Leonardo da Vinci was an Italian painter and inventor of the Renaissance, born in Vinci in 1452."),
    ("William Shakespeare", "William Shakespeare was an English playwright and poet, born in Stratford-upon-Avon in 1564."),
    ("Napoleon", "Napoleon Bonaparte was born in Ajaccio, Corsica, in 1769 and crowned Emperor of the French in 1804."),
    ("Julius Caesar", "Julius Caesar was a Roman general and statesman who was assassinated on the Ides of March in 44 BC."),
    ("Cleopatra", "Cleopatra was the last active ruler of the Ptolemaic Kingdom of Egypt."),
    ("Genghis Khan", "Genghis Khan was the founder and first Great Khan of the Mongol Empire."),
    ("George Washington", "George Washington was the first president of the United States, from 1789 to 1797."),
    ("Abraham Lincoln", "Abraham Lincoln was the 16th president of the United States and led the country through the American Civil War."),
    ("Mahatma Gandhi", "Mahatma Gandhi led the Indian independence movement against British rule through nonviolent resistance."),
    ("Nelson Mandela", "Nelson Mandela became the first black president of South Africa in 1994."),
    ("Christopher Columbus", "Christopher Columbus was an explorer born in Genoa who crossed the Atlantic Ocean in 1492 in the service of Spain."),
    ("Ferdinand Magellan", "Ferdinand Magellan was a Portuguese explorer who led the Spanish expedition of 1519 to 1522 that first sailed around the world."),
    ("Martin Luther King Jr.", "Martin Luther King Jr. was an American civil rights leader who gave the I Have a Dream speech in Washington in 1963."),
    ("Winston Churchill", "Winston Churchill was the Prime Minister of the United Kingdom during most of the Second World War."),
]

# title, text
EVENTS = [
    ("1896 Summer Olympics", "The 1896 Summer Olympics in Athens, Greece, were the first modern Olympic Games."),
    ("1930 FIFA World Cup", "The first FIFA World Cup was held in Uruguay in 1930, and Uruguay won it."),
    ("World War I", "World War I lasted from 1914 to 1918."),
    ("World War II", "World War II lasted from 1939 to 1945."),
    ("French Revolution", "The French Revolution began in 1789; the storming of the Bastille took place on 14 July 1789."),
    ("Fall of the Berlin Wall", "The Berlin Wall fell on 9 November 1989."),
    ("Titanic", "The RMS Titanic sank in the North Atlantic Ocean in April 1912 on her maiden voyage, after striking an iceberg."),
    ("United States Declaration of Independence", "The United States Declaration of Independence was adopted on 4 July 1776."),
    ("Magna Carta", "Magna Carta was a charter of rights agreed to by King John of England in 1215."),
]

# title, text
NATURE = [
    ("Blue whale", "The blue whale is the largest animal known ever to have lived."),
    ("Cheetah", "The cheetah is the fastest land animal."),
    ("Giraffe", "The giraffe is the tallest living land animal."),
    ("Octopus", "An octopus has three hearts and eight arms."),
    ("Emperor penguin", "The emperor penguin is the tallest and heaviest of all penguins and breeds in Antarctica."),
    ("Heart", "The human heart has four chambers: two atria and two ventricles."),
    ("Human skeleton", "The adult human skeleton has 206 bones."),
    ("Photosynthesis", "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make glucose and release oxygen."),
    ("Speed of light", "The speed of light in a vacuum is 299,792,458 metres per second."),
    ("Boiling point of water", "At sea level, water boils at 100 degrees Celsius."),
]

# question, gold answers (the first must occur in the corpus)
QUESTIONS = [
    ("What is the capital of Australia?", ["Canberra"]),
    ("What is the capital of Canada?", ["Ottawa"]),
    ("Which currency is used in Switzerland?", ["Swiss franc", "franc", "CHF"]),
    ("What is the main language of Brazil?", ["Portuguese"]),
    ("What is the chemical symbol of gold?", ["Au"]),
    ("What is the atomic number of iron?", ["26"]),
    ("Who wrote Pride and Prejudice?", ["Jane Austen", "Austen"]),
    ("In what year was Nineteen Eighty-Four first published?", ["1949"]),
    ("Who wrote One Hundred Years of Solitude?", ["Gabriel Garcia Marquez", "Gabriel García Márquez", "Garcia Marquez"]),
    ("Who painted The Night Watch?", ["Rembrandt", "Rembrandt van Rijn"]),
    ("Who painted Girl with a Pearl Earring?", ["Johannes Vermeer", "Vermeer"]),
    ("In which museum is the Mona Lisa kept?", ["Louvre", "Louvre Museum", "Musee du Louvre"]),
    ("Who was granted the first patent for the telephone?", ["Alexander Graham Bell", "Graham Bell", "Bell"]),
    ("Who discovered penicillin?", ["Alexander Fleming", "Fleming"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("Who composed The Four Seasons?", ["Antonio Vivaldi", "Vivaldi"]),
    ("Who composed the ballet Swan Lake?", ["Pyotr Ilyich Tchaikovsky", "Tchaikovsky"]),
    ("What is the highest mountain in Africa?", ["Mount Kilimanjaro", "Kilimanjaro"]),
    ("Into which sea does the Volga flow?", ["Caspian Sea", "Caspian"]),
    ("Which river flows through London?", ["River Thames", "Thames"]),
    ("In which city is the Taj Mahal?", ["Agra"]),
    ("Who designed the Sydney Opera House?", ["Jorn Utzon", "Jørn Utzon", "Utzon"]),
    ("In which city was Albert Einstein born?", ["Ulm"]),
    ("Who was the first president of the United States?", ["George Washington", "Washington"]),
    ("Which country hosted the first FIFA World Cup?", ["Uruguay"]),
    ("What is the fastest land animal?", ["cheetah"]),
    ("How many bones does the adult human skeleton have?", ["206"]),
    ("What is the deepest lake in the world?", ["Lake Baikal", "Baikal"]),
    # two hops: find the entity, then the fact about it
    ("What currency is used in the country whose capital is Nairobi?", ["Kenyan shilling", "shilling"]),
    ("What is the capital of the country where the Colosseum is?", ["Rome"]),
    ("What is the capital of the country where Machu Picchu is?", ["Lima"]),
    ("What is the main language of the country whose capital is Hanoi?", ["Vietnamese"]),
]


def passages() -> list[tuple[str, str]]:
    """(title, text) of every passage, in a fixed order."""
    out = []
    for name, capital, continent, currency, language in COUNTRIES:
        the = "the " if name in PLURAL_OR_UNION else ""
        languages = "languages are" if " and " in language else "language is"
        out.append((name, f"{the.capitalize()}{name} is a country in {continent}. Its capital is {capital}, its currency "
                          f"is {currency} and its main {languages} {language}."))
        out.append((capital, f"{capital} is the capital city of {the}{name}."))
    for name, symbol, number, fact in ELEMENTS:
        element = name.split(" (")[0]
        out.append((name, f"{element} is a chemical element with the symbol {symbol} and atomic number {number}. {fact}"))
    out.extend(PLANETS)
    for title, author, year in BOOKS:
        published = f", first published in {year}" if year else ""
        out.append((title, f"{title} is a work by {author}{published}."))
    for title in PLAYS:
        out.append((title, f"{title} is a tragedy written by William Shakespeare."))
    for title, painter, place in PAINTINGS:
        where = f" It is {place}." if place else ""
        out.append((title, f"{title} is a work by the artist {painter}.{where}"))
    out.extend(DISCOVERIES)
    for name, nationality, work in COMPOSERS:
        out.append((name, f"{name} was a {nationality} composer, known for {work}."))
    for table in (PLACES, PEOPLE, EVENTS, NATURE):
        out.extend(table)
    return out


def load_env():
    """envs/search.py as a module (for its prompt), without putting envs/ on sys.path (its files would
    shadow modules of the same name); the repository root is, so the env finds rl2 uninstalled."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    spec = importlib.util.spec_from_file_location("search_env", ENV_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=HERE, help="output folder")
    args = parser.parse_args()
    env = load_env()

    rows = [{"id": str(i), "contents": f"{title}\n{text}"} for i, (title, text) in enumerate(passages())]
    titles = [row["contents"].split("\n")[0] for row in rows]
    assert len(set(titles)) == len(titles), "duplicate passage titles"
    corpus_text = " " + " ".join(env.normalize_answer(row["contents"]) for row in rows) + " "
    for question, answers in QUESTIONS:
        gold = env.normalize_answer(answers[0])
        assert f" {gold} " in corpus_text, f"answer {answers[0]!r} to {question!r} is not in the corpus"

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "search_corpus.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "search_qa.jsonl"), "w") as f:
        for question, answers in QUESTIONS:
            row = {"messages": [{"role": "user", "content": env.make_prompt(question)}], "answer": answers}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} passages and {len(QUESTIONS)} questions to {args.out}")


if __name__ == "__main__":
    main()
